"""The layers under activation checkpointing, selective checkpointing and torch.compile."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from layer_counting import saved_bytes
from layer_models import small_cnn
from memsave_nb.layers import convert


def grads_of(model: nn.Module, x: torch.Tensor, wrap=None) -> tuple[torch.Tensor, list]:
    xi = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    out = wrap(model, xi) if wrap else model(xi)
    out.square().sum().backward()
    grads = [xi.grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads


def assert_grads_close(a: list, b: list) -> None:
    for ga, gb in zip(a, b):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(gb, ga)


def _policy(ctx, op, *args, **kwargs):  # keep convolutions, recompute the rest
    if op is torch.ops.aten.convolution.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


WRAPS = {
    "checkpoint": lambda m, x: checkpoint(m, x, use_reentrant=False),
    "sac": lambda m, x: checkpoint(
        m,
        x,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _policy),
    ),
}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("frozen", [False, True])
def test_checkpointed_converted_model_matches_stock(wrap: str, frozen: bool) -> None:
    torch.manual_seed(0)
    stock = small_cnn()
    stock[:5].requires_grad_(not frozen)
    ours = copy.deepcopy(stock)
    convert(ours)
    x = torch.randn(2, 3, 8, 8)
    ya, ga = grads_of(stock, x)
    yb, gb = grads_of(ours, x, WRAPS[wrap])
    torch.testing.assert_close(yb, ya)
    assert_grads_close(ga, gb)


def test_checkpoint_drops_what_the_layers_keep() -> None:
    model = small_cnn()
    convert(model)
    params = list(model.parameters()) + list(model.buffers())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    plain = saved_bytes(lambda t: model(t * 1), x, params=params)
    ckpt = saved_bytes(lambda t: checkpoint(model, t * 1, use_reentrant=False), x, params=params)
    assert ckpt == x.numel() * 4 < plain  # only the region's input stays


@pytest.mark.parametrize("frozen", [False, True])
def test_compiled_converted_model_matches_stock(frozen: bool) -> None:
    torch.manual_seed(0)
    stock = small_cnn().eval()  # eval: no dropout draw to line up between compiled/eager
    stock[:5].requires_grad_(not frozen)
    ours = copy.deepcopy(stock)
    convert(ours)
    compiled = torch.compile(ours, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8)
    ya, ga = grads_of(stock, x)
    yb, gb = grads_of(compiled, x)
    torch.testing.assert_close(yb, ya)
    assert_grads_close(ga, gb)


@pytest.mark.parametrize("frozen", [False, True])
def test_autocast_is_as_accurate_as_stock(frozen: bool) -> None:
    """Under CPU autocast (bfloat16) outputs equal stock's; gradients are as close to the
    float32 gradients as stock's are (bfloat16 rounding differs between the two)."""
    torch.manual_seed(0)
    stock = small_cnn().eval()
    stock.requires_grad_(not frozen)
    ours = copy.deepcopy(stock)
    convert(ours)
    x = torch.randn(2, 3, 8, 8)

    def step(model: nn.Module, autocast: bool) -> tuple[torch.Tensor, list]:
        xi = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(xi)
        out.float().square().sum().backward()
        return out.detach(), [xi.grad] + [p.grad for p in model.parameters()]

    _, reference = step(stock, autocast=False)
    ya, ga = step(stock, autocast=True)
    yb, gb = step(ours, autocast=True)
    assert ya.dtype == yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    for ref, a, b in zip(reference, ga, gb):
        assert (a is None) == (b is None)
        if a is not None:
            assert b.dtype == a.dtype
            stock_error = (a - ref).norm() / ref.norm()
            ours_error = (b - ref).norm() / ref.norm()
            assert ours_error <= 2 * stock_error + 1e-2


@pytest.mark.parametrize("train,frozen", [(False, True), (True, False), (True, True)])
def test_no_graph_breaks(train: bool, frozen: bool) -> None:
    model = small_cnn().train(train)
    model.requires_grad_(not frozen)
    convert(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(2, 3, 8, 8, requires_grad=True))
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
