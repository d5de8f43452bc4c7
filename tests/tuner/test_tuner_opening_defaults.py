"""What the explorer says when it opens (issue 28, item 8), driven through widgets without a
browser: fake mode names a model's own loss, "max seq len" says why it cannot run for a batch
function, and the target starts at the smallest preset the step could plausibly fit, or none."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.target import GIB, PRESETS_GB
from memsave_nb.ui.explorer import Explorer, explore
from memsave_nb.workload import Workload

pytestmark = pytest.mark.timeout(300)
TINY_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return {"logits": y, "loss": y.square().mean()}


def _wide_fake_gpt(n_embd: int) -> Workload:
    """A GPT too large for any one preset (built under FakeTensorMode, bf16), its batch a function."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = zoo.GPTConfig(vocab_size=256, block_size=8, n_layer=4, n_head=8, n_embd=n_embd, dropout=0.0, bias=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            model = zoo.GPT(cfg)
    finally:
        torch.set_default_dtype(previous)

    def batch():
        idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size))
        return {"idx": idx, "targets": idx}

    return Workload(model, batch, name="wide")


def test_fake_mode_names_the_models_own_loss():
    for mode in ("real", "fake"):
        ex = explore(OwnLoss(), torch.randn(2, 4), mode=mode, repeats=0, live=False)
        assert "the model's own <code>loss</code>" in ex.loss_note.value, (mode, ex.loss_note.value)
        assert "sum" not in ex.loss_note.value
    plain = explore(nn.Linear(4, 4), torch.randn(2, 4), mode="fake", repeats=0, live=False)
    assert "sum of the model's output" in plain.loss_note.value


def test_tiny_step_starts_at_the_smallest_preset_and_fits():
    ex = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=4), mode="fake", repeats=0), live=False)
    panel = ex.tuner
    assert panel.target_gb.value == panel.target_menu.value == float(min(PRESETS_GB))
    assert ex.target is not None and ex.target.gb == min(PRESETS_GB)
    assert "memsave-fits" in panel.verdict.value
    assert not panel.max_seq_button.disabled and panel.max_seq_result.value == ""  # token ids: it can run


@pytest.mark.slow
def test_too_large_for_every_preset_opens_without_a_target_and_says_why_seq_len_cannot_run():
    ex = Explorer(Session(_wide_fake_gpt(24576), mode="fake", repeats=0), live=False)
    panel = ex.tuner
    split = ex.measurement.peak_split
    floor = split.parameters + split.gradients + split.optimizer_state
    assert floor > max(PRESETS_GB) * GIB * 0.8  # the oracle: even the weights' side cannot fit 141 GB
    assert ex.target is None and panel.no_target
    assert "no target yet" in panel.line.value and panel.verdict.value == ""
    assert "%" not in ex.target_verdict.value  # no "2685%" against a card nobody chose
    # the button is there, greyed, with the reason
    assert panel.max_seq_button.layout.display != "none" and panel.max_seq_button.disabled
    assert "the batch is a function" in panel.max_seq_result.value
    assert "the batch is a function" in panel.max_seq_button.tooltip
    # choosing a size makes it the target
    panel.target_menu.value = 80.0
    assert ex.target is not None and ex.target.gb == 80.0 and not panel.no_target
    assert "does not fit" in panel.verdict.value
