"""Nothing the layers hold outlives backward, so a converted step never peaks above stock's
(issue 11 section 1: the optimizer step used to run beside held ReLU outputs)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from layer_counting import LiveStorages
from layer_models import small_cnn
from memsave_nb.layers import convert, revert
from memsave_nb.measure import measure
from memsave_nb.workload import Workload


def _case(model: nn.Module, case: str) -> bool:
    """Freeze / eval as the bench's paper cases do; returns whether the input needs grad."""
    model.train()
    model.requires_grad_(case in ("all", "first"))
    if case == "first":
        model[2:].requires_grad_(False)
    if case == "input_bn_eval":
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
    return case in ("input", "input_bn_eval", "first")


def _alive_after_backward(
    model: nn.Module, x: torch.Tensor, input_grad: bool, retain: bool = False
) -> dict[tuple, int]:
    """(shape, dtype) -> count of storages made during the step and alive after backward,
    with the loss (and so the whole graph's nodes) still alive, as in a training step."""
    mode = LiveStorages()
    xi = x.clone().requires_grad_(input_grad)
    torch.manual_seed(1)
    with mode:
        loss = model(xi).square().sum()
        loss.backward(retain_graph=retain)
    keep = {t.untyped_storage()._cdata for t in [xi, loss, *model.parameters(), *model.buffers()]}
    keep |= {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
    if xi.grad is not None:
        keep.add(xi.grad.untyped_storage()._cdata)
    alive = [nbytes for key, (ref, nbytes) in mode.created.items() if not ref.expired() and key not in keep]
    model.zero_grad(set_to_none=True)
    return {"count": len(alive), "bytes": sum(alive)}


@pytest.mark.parametrize("case", ["all", "input", "input_bn_eval", "first"])
def test_nothing_alive_after_backward_beyond_stock(case: str) -> None:
    torch.manual_seed(0)
    stock = small_cnn(8)
    input_grad = _case(stock, case)
    ours = copy.deepcopy(stock)
    convert(ours)
    x = torch.randn(2, 3, 16, 16)
    a = _alive_after_backward(stock, x, input_grad)
    b = _alive_after_backward(ours, x, input_grad)
    assert b == a


def test_retain_graph_keeps_what_a_second_backward_needs() -> None:
    torch.manual_seed(0)
    model = small_cnn(8)
    convert(model)
    x = torch.randn(2, 3, 16, 16, requires_grad=True)
    loss = model(x).square().sum()
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g2, g1, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["all", "input"])
def test_converted_peak_with_adamw_not_above_stock(case: str) -> None:
    """The engine's peak of a full step (forward, backward, AdamW) with the project's engine."""
    torch.manual_seed(0)
    model = small_cnn(16)
    model[-1] = nn.Linear(16, 20000)  # a large head: the optimizer step is the step's peak
    input_grad = _case(model, case)
    model[-1].requires_grad_(True)
    x = torch.randn(4, 3, 32, 32)
    workload = Workload(
        model,
        x,
        loss=lambda out: out.square().sum(),
        optimizer=lambda ps: torch.optim.AdamW(ps),
        input_requires_grad=input_grad,
    )
    stock = measure(workload, mode="real", repeats=0, flops=False)
    conversion = convert(model)
    try:
        ours = measure(workload, mode="real", repeats=0, flops=False)
    finally:
        revert(conversion)
    assert stock.peak_phase == "optimizer"
    assert ours.peak_bytes <= stock.peak_bytes
    assert ours.saved_bytes < stock.saved_bytes


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True])
def test_zoo_cnn_converted_peak_not_above_stock(frozen: bool) -> None:
    """The demo ResNet-style CNN with AdamW (fake mode, batch 2, as issue 11 measured)."""
    from memsave_nb.zoo import make

    workload = make("cnn", batch_size=2)
    model = workload.model
    if frozen:  # fine-tuning the head only, input gradient off
        model.requires_grad_(False)
        list(model.modules())[-1].requires_grad_(True)
    workload = Workload(model, workload.batch, loss=workload.loss, optimizer=lambda ps: torch.optim.AdamW(ps))
    stock = measure(workload, mode="fake", repeats=0, flops=False)
    conversion = convert(model)
    try:
        ours = measure(workload, mode="fake", repeats=0, flops=False)
    finally:
        revert(conversion)
    assert ours.peak_bytes <= stock.peak_bytes
