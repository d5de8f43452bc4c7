"""After measure() the model is exactly as it was: values bit for bit, grads, flags, modes, hooks."""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure
from memsave_nb.model_state import ModelSnapshot


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_model_left_exactly_as_it_was(case, mode):
    wl = case.build()
    model = wl.model
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))  # a user's hook survives and still fires
    first = (
        next(p for p in model.parameters() if p.requires_grad)
        if any(p.requires_grad for p in model.parameters())
        else None
    )
    if first is not None:
        first.grad = torch.full_like(first, 0.5)  # a user's pending grad is neither freed nor accumulated into
    grad_before = first.grad if first is not None else None
    before = ModelSnapshot.capture(model)
    state = {k: _bits(v) for k, v in model.state_dict().items()}
    modes = {n: m.training for n, m in model.named_modules()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    measure(wl, mode, repeats=1 if mode == "real" else 0)
    assert before.differences(model) == []
    assert {k: _bits(v) for k, v in model.state_dict().items()} == state
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    if first is not None:
        assert first.grad is grad_before and torch.all(first.grad == 0.5)
    calls.clear()
    with torch.no_grad():
        wl.forward(wl.make_batch())
    assert calls == [1]
    handle.remove()


def test_eval_mode_and_batchnorm_counter_kept():
    from memsave_nb import zoo

    wl = zoo.make("cnn", 2)
    wl.model.eval()
    wl.model.stem[1].train()
    tracked = wl.model.stem[1].num_batches_tracked.clone()
    measure(wl, repeats=2)
    assert not wl.model.training and wl.model.stem[1].training
    assert torch.equal(wl.model.stem[1].num_batches_tracked, tracked)
