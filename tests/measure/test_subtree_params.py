"""Each module's subtree parameter counts come from one pass from the leaves up
(summary._subtree_params); they must equal what ``mod.parameters()`` per module gives (the old
walk, a tied weight once), on tied weights, a module registered twice, frozen parts and LoRA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.measure import summary


def _oracle(model: nn.Module) -> dict[str, tuple[int, int]]:
    out = {}
    for name, mod in model.named_modules():
        params = list(mod.parameters())  # torch's own walk, deduplicated
        trainable = sum(p.numel() for p in params if p.requires_grad)
        out[name] = (trainable, sum(p.numel() for p in params) - trainable)
    return out


def _ours(model: nn.Module) -> dict[str, tuple[int, int]]:
    named = list(model.named_modules())
    by_id = summary._subtree_params(named)
    return {name: by_id[id(mod)] for name, mod in named}


class _TiedShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        shared = nn.Linear(6, 6)
        self.body = nn.Sequential(shared, nn.ReLU(), shared)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied head
        shared.bias.requires_grad_(False)
        self.extra = nn.ModuleDict({"again": self.body})  # a whole block registered twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.extra["again"](self.body(self.emb(ids))))


def _tied_and_shared() -> nn.Module:
    return _TiedShared()


def test_equal_to_torchs_walk_on_tied_weights_and_a_module_registered_twice():
    model = _tied_and_shared()
    assert _ours(model) == _oracle(model)
    assert _ours(model)[""] == (11 * 6 + 36, 6)  # the tied weight and the shared block once


def test_equal_to_torchs_walk_on_a_lora_model():
    pytest.importorskip("peft")
    from memsave_nb.hub import from_pretrained

    wl = from_pretrained("qwen2.5-0.5b", lora=dict(r=4), seq_len=16, overrides={"num_hidden_layers": 2})
    assert _ours(wl.model) == _oracle(wl.model)


def test_measurement_rows_equal_with_and_without_the_one_pass():
    from memsave_nb import measure
    from memsave_nb.workload import Workload

    model = _tied_and_shared()
    wl = Workload(model, torch.randint(0, 11, (2, 5)), loss=lambda out: out.float().mean())
    quick = measure(wl, repeats=0)
    summary.ONE_PASS_SUBTREES = False
    try:
        walked = measure(wl, repeats=0)
    finally:
        summary.ONE_PASS_SUBTREES = True
    assert quick.modules == walked.modules
