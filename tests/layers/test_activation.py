"""ReLU / LeakyReLU: bit-exact against torch.nn, 1 bit per element kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes, saved_bytes
from memsave_nb.layers import MemSaveConv2d, MemSaveLeakyReLU, MemSaveReLU, compact


def make(slope: float | None, inplace: bool) -> nn.Module:
    return nn.ReLU(inplace) if slope is None else nn.LeakyReLU(slope, inplace)


def ours_of(stock: nn.Module) -> nn.Module:
    return twin(stock, MemSaveReLU if type(stock) is nn.ReLU else MemSaveLeakyReLU)


@settings(max_examples=40, deadline=None)
@given(
    slope=st.sampled_from([None, 0.0, 0.01, 0.3, -0.5]),
    inplace=st.booleans(),
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    hooks=st.booleans(),
    compact_first=st.booleans(),
    seed=st.integers(0, 999),
)
def test_activation_matches_stock(
    slope: float | None,
    inplace: bool,
    shape: list[int],
    dtype: torch.dtype,
    hooks: bool,
    compact_first: bool,
    seed: int,
) -> None:
    if inplace and slope is not None and slope < 0:
        inplace = False  # stock refuses in-place backward with a negative slope
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype)
    x.view(-1)[0] = 0.0  # the kink: both must route the gradient the same way
    if x.numel() > 2:
        x.view(-1)[1] = float("nan")  # NaN passes or stops the gradient exactly as in stock
        x.view(-1)[2] = -0.0
    stock = make(slope, inplace)
    a = run(stock, x, {"input": True})
    if hooks:  # a saved-tensor hook active: the mask is packed at once
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            b = run(ours_of(stock), x, {"input": True})
    else:  # output held, compacted to a mask when the last holder
        if compact_first:
            compact()
        b = run(ours_of(stock), x, {"input": True})
    assert_same(a, b, exact_output=True, exact_grads=True)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 4097])
@pytest.mark.parametrize("slope", [None, 0.1, -0.2])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("hooks", [False, True])
def test_activation_keeps_one_bit_per_element(numel: int, slope: float | None, inplace: bool, hooks: bool) -> None:
    if inplace and slope is not None and slope < 0:
        pytest.skip("stock refuses in-place leaky ReLU backward with a negative slope")
    layer = ours_of(make(slope, inplace))
    x = torch.randn(numel, requires_grad=True)
    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            got = module_saved_bytes(layer, x)
    else:
        got = module_saved_bytes(layer, x)
    assert got == -(-numel // 8)


@pytest.mark.parametrize("cls", [MemSaveReLU, MemSaveLeakyReLU])
def test_no_mask_beside_an_output_the_next_layer_keeps(cls: type[nn.Module]) -> None:
    """A trainable conv keeps the activation's output anyway: nothing extra is kept."""
    act, conv = cls(), MemSaveConv2d(4, 4, 3)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    params = list(conv.parameters())
    both = saved_bytes(lambda t: conv(act(t * 1)), x, params=params)
    assert both == x.numel() * 4  # the activation output, once
    conv.requires_grad_(False)
    frozen = saved_bytes(lambda t: conv(act(t * 1)), x, params=params)
    assert frozen == -(-x.numel() // 8)  # conv keeps nothing, activation its mask


def test_output_modified_in_place_raises_like_stock() -> None:
    for layer in (nn.ReLU(), MemSaveReLU()):
        x = torch.randn(5, requires_grad=True)
        y = layer(x * 1)
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_inplace_returns_the_input_tensor() -> None:
    x = torch.randn(5, requires_grad=True)
    h = x * 1
    assert MemSaveReLU(inplace=True)(h) is h


def test_fake_tensor_run_leaves_no_fake_state_behind() -> None:
    """A step under FakeTensorMode (how the engine sizes big models) must not cache fake
    tensors that a later real step would then compute with."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = MemSaveReLU()
    with FakeTensorMode():
        x = torch.randn(64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            layer(x * 1).sum().backward()
    run(nn.ReLU(), torch.randn(64), {"input": True})
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        ours = run(layer, torch.randn(64), {"input": True})
    assert type(ours.grads["input"]) is torch.Tensor
