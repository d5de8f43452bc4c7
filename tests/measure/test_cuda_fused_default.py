"""The trainer's fused default, sized as CUDA runs it (issue 40 part 2).

``TrainingArguments.optim`` defaults to ``adamw_torch_fused`` (transformers, torch >= 2.8; TRL's
``SFTConfig`` inherits it), so a config that names no optimizer runs torch's fused AdamW:
``torch._fused_adamw_`` updates parameters and state in place (``native_functions.yaml``:
``Tensor(a!)[] self``) and allocates nothing, where the foreach step's ``_foreach_sqrt`` makes a copy
of every ``exp_avg_sq`` (``torch/optim/adamw.py``, ``_multi_tensor_adamw``): at least the
trainable parameters' bytes more during the step."""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure
from memsave_nb.hub import from_pretrained
from memsave_nb.trainers import from_trainer

SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    seq_len=64,
)


def _step_bytes(m) -> int:
    """Bytes the optimizer step allocated above what was live when it began (0: none)."""
    tl, total = m.timeline, m.timeline.total()
    start = tl.phase_starts.get("optimizer")
    if start is None:
        return 0
    end = tl.phase_starts.get("done", len(total))
    before = total[start - 1] if start else 0
    return max(total[start:end]) - before


@pytest.mark.parametrize(
    "trainer, config",
    [
        ("hf", {"per_device_train_batch_size": 2}),
        ("trl", {"per_device_train_batch_size": 2, "gradient_checkpointing": False, "bf16": False}),
    ],
)
def test_a_config_without_optim_is_sized_with_the_fused_step(trainer, config):
    wl = from_pretrained("qwen2.5-0.5b", dtype=torch.float32, **SMALL)
    imported = from_trainer(config, wl.model, trainer=trainer)
    assert imported.plan.optimizer == "adamw_fused"
    with imported.plan.apply(wl) as applied:
        assert {g["fused"] for g in applied.make_optimizer().param_groups} == {True}
        fused = measure(applied, mode="fake")
    with imported.plan.replace(optimizer="adamw_foreach").apply(wl) as applied:
        foreach = measure(applied, mode="fake")
    trainable = sum(p.numel() * p.element_size() for p in wl.model.parameters() if p.requires_grad)
    assert fused.notes[0].startswith("sized as CUDA runs it: fused optimizer step")
    assert foreach.notes[0].startswith("sized as CUDA runs it: foreach optimizer step")
    assert _step_bytes(fused) == 0
    assert _step_bytes(foreach) >= trainable
