"""ReLU6/Hardtanh, Dropout1d/2d/3d, AlphaDropout/FeatureAlphaDropout, AdaptiveMaxPool1d/2d/3d
against torch.nn over their options, and the bytes each keeps (issue 11 section 2)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes, saved_bytes
from memsave_nb.layers import MEMSAVE_LAYERS, convert


def ours_of(stock: nn.Module) -> nn.Module:
    return twin(stock, MEMSAVE_LAYERS[type(stock)])


# -- ReLU6 / Hardtanh ---------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    bounds=st.sampled_from([None, (-1.0, 1.0), (0.0, 6.0), (-0.5, 2.0), (0.25, 0.5)]),
    inplace=st.booleans(),
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    hooks=st.booleans(),
    seed=st.integers(0, 999),
)
def test_hardtanh_matches_stock(
    bounds, inplace: bool, shape: list[int], dtype: torch.dtype, hooks: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    x = torch.randn(shape, dtype=dtype) * 4
    flat = x.view(-1)
    # the bounds themselves; not NaN: stock's own hardtanh_backward passes a NaN's gradient
    # in its scalar tail and stops it in its vectorised body (ours always stops it)
    edges = [0.0, 6.0, -1.0, 1.0] if bounds is None else list(bounds)
    for i, v in enumerate(edges[: flat.numel()]):
        flat[i] = v
    stock = nn.ReLU6(inplace) if bounds is None else nn.Hardtanh(*bounds, inplace=inplace)
    a = run(stock, x, {"input": True})
    if hooks:  # a saved-tensor hook active: the mask is packed at once
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            b = run(ours_of(stock), x, {"input": True})
    else:
        b = run(ours_of(stock), x, {"input": True})
    assert_same(a, b, exact_output=True, exact_grads=True)


@pytest.mark.parametrize("numel", [1, 9, 1000])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("hooks", [False, True])
def test_relu6_keeps_one_bit_per_element(numel: int, inplace: bool, hooks: bool) -> None:
    x = torch.randn(numel, requires_grad=True)
    stock = module_saved_bytes(nn.ReLU6(inplace), x)
    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ours = module_saved_bytes(MEMSAVE_LAYERS[nn.ReLU6](inplace), x)
    else:
        ours = module_saved_bytes(MEMSAVE_LAYERS[nn.ReLU6](inplace), x)
    assert stock == numel * 4
    assert ours == -(-numel // 8)


def test_relu6_keeps_no_mask_beside_an_output_the_next_conv_keeps() -> None:
    """MobileNetV2's ReLU6(inplace) -> trainable conv: the conv keeps the output, so we keep
    nothing beside it. Stock keeps a copy of the input on top: autograd's formula for
    ``hardtanh_`` reads the input, so it clones it before the op overwrites it."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU6(inplace=True), nn.Conv2d(8, 8, 1))
    ours = copy.deepcopy(stock)
    convert(ours)
    x = torch.randn(2, 3, 8, 8)
    params = list(stock.parameters())
    a = saved_bytes(stock, x, params=params)
    b = saved_bytes(ours, x, params=list(ours.parameters()))
    n = 2 * 8 * 8 * 8
    assert (a, b) == (2 * n * 4, n * 4)
    stock[2].requires_grad_(False)
    ours[2].requires_grad_(False)
    a = saved_bytes(stock, x, params=params)
    b = saved_bytes(ours, x, params=list(ours.parameters()))
    # a frozen conv: stock's still keeps its input (and the clone stays); ours nothing: bits
    assert (a, b) == (2 * n * 4, n // 8)


# -- feature and alpha dropout ------------------------------------------------------------------
DROPOUTS = {
    "dropout1d": (nn.Dropout1d, 3),
    "dropout2d": (nn.Dropout2d, 4),
    "dropout3d": (nn.Dropout3d, 5),
    "alpha": (nn.AlphaDropout, None),
    "feature_alpha": (nn.FeatureAlphaDropout, None),
}


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(sorted(DROPOUTS)),
    p=st.sampled_from([0.0, 0.1, 0.5, 0.77, 1.0]),
    inplace=st.booleans(),
    training=st.booleans(),
    unbatched=st.booleans(),
    dims=st.integers(2, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 999),
)
def test_dropouts_match_stock(
    kind: str, p: float, inplace: bool, training: bool, unbatched: bool, dims: int, dtype: torch.dtype, seed: int
) -> None:
    cls, batched_dim = DROPOUTS[kind]
    if batched_dim is not None:
        dims = batched_dim - (1 if unbatched else 0)
    gen = torch.Generator().manual_seed(seed)
    shape = torch.randint(1, 5, (dims,), generator=gen).tolist()
    stock = cls(p, inplace).train(training)
    x = torch.randn(shape, dtype=dtype)
    torch.manual_seed(seed)
    a = run(stock, x, {"input": True})
    torch.manual_seed(seed)
    b = run(ours_of(stock), x, {"input": True})
    assert_same(a, b, exact_output=True, exact_grads=True)


@pytest.mark.parametrize("kind", ["dropout1d", "dropout2d", "dropout3d", "feature_alpha"])
def test_feature_dropouts_keep_one_bit_per_channel(kind: str) -> None:
    cls, batched_dim = DROPOUTS[kind]
    shape = [3, 5] + [4] * ((batched_dim or 4) - 2)
    x = torch.randn(shape, requires_grad=True)
    torch.manual_seed(0)
    stock = module_saved_bytes(cls(0.3), x)
    torch.manual_seed(0)
    ours = module_saved_bytes(MEMSAVE_LAYERS[cls](0.3), x)
    channels = 3 * 5
    # stock: the float noise per channel (and, for alpha, nothing else); ours: its bits
    assert (stock, ours) == (channels * 4, -(-channels // 8))


@pytest.mark.parametrize("numel", [1, 9, 1000])
def test_alpha_dropout_keeps_one_bit_per_element(numel: int) -> None:
    x = torch.randn(numel, requires_grad=True)
    torch.manual_seed(0)
    stock = module_saved_bytes(nn.AlphaDropout(0.2), x)
    ours = module_saved_bytes(MEMSAVE_LAYERS[nn.AlphaDropout](0.2), x)
    assert (stock, ours) == (numel * 4, -(-numel // 8))


# -- adaptive max pooling -----------------------------------------------------------------------
ADAPTIVE = {1: nn.AdaptiveMaxPool1d, 2: nn.AdaptiveMaxPool2d, 3: nn.AdaptiveMaxPool3d}


@settings(max_examples=50, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3]),
    sizes=st.lists(st.integers(1, 11), min_size=3, max_size=3),
    outs=st.lists(st.one_of(st.none(), st.integers(1, 6)), min_size=3, max_size=3),
    batch=st.sampled_from([0, 1, 3]),  # 0: unbatched
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    channels_last=st.booleans(),
    seed=st.integers(0, 999),
)
def test_adaptive_maxpool_matches_stock(
    n: int, sizes: list[int], outs: list, batch: int, dtype: torch.dtype, channels_last: bool, seed: int
) -> None:
    out_size = outs[:n] if n > 1 else outs[0]
    assume(n > 1 or out_size is not None)
    torch.manual_seed(seed)
    stock = ADAPTIVE[n](out_size)
    shape = ([batch] if batch else []) + [3] + sizes[:n]
    x = torch.randn(shape, dtype=dtype)
    if channels_last and batch and n > 1:
        x = x.to(memory_format=torch.channels_last if n == 2 else torch.channels_last_3d)
    a = run(stock, x, {"input": True})
    b = run(ours_of(stock), x, {"input": True})
    assert_same(a, b, exact_output=True, exact_grads=True)


@pytest.mark.parametrize(
    "n,size,out,index_dtype",
    [
        (1, 20, 5, torch.uint8),
        (2, 14, 7, torch.uint8),
        (2, 7, 1, torch.uint8),
        (3, 6, 3, torch.uint8),
        (2, 40, 2, torch.int16),
    ],
)
def test_adaptive_maxpool_keeps_window_offsets(n: int, size: int, out: int, index_dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, *([size] * n), requires_grad=True)
    out_numel = 2 * 3 * out**n
    stock = module_saved_bytes(ADAPTIVE[n](out), x)
    ours = module_saved_bytes(MEMSAVE_LAYERS[ADAPTIVE[n]](out), x)
    assert stock == x.numel() * 4 + out_numel * 8
    assert ours == out_numel * index_dtype.itemsize


def test_adaptive_maxpool_return_indices_is_stock() -> None:
    stock = nn.AdaptiveMaxPool2d(3, return_indices=True)
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    (ya, ia), (yb, ib) = stock(x), ours_of(stock)(x)
    assert torch.equal(ya, yb) and torch.equal(ia, ib)


def test_new_layers_are_converted() -> None:
    model = nn.Sequential(
        nn.ReLU6(),
        nn.Hardtanh(),
        nn.Dropout1d(),
        nn.Dropout2d(),
        nn.Dropout3d(),
        nn.AlphaDropout(),
        nn.FeatureAlphaDropout(),
        nn.AdaptiveMaxPool1d(2),
        nn.AdaptiveMaxPool2d(2),
        nn.AdaptiveMaxPool3d(2),
    )
    originals = [type(m) for m in model]
    conversion = convert(model)
    assert len(conversion) == len(model)
    assert all(type(m) is MEMSAVE_LAYERS[o] and isinstance(m, o) for m, o in zip(model, originals))
    conversion.revert()
    assert [type(m) for m in model] == originals
