"""Max pooling against torch.nn, keeping a window-local argmax in the smallest integer type."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes
from memsave_nb.layers import MEMSAVE_LAYERS
from memsave_nb.layers import pool
from memsave_nb.layers.pool import window_index_dtype

POOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}


@st.composite
def pool_case(draw: st.DrawFn) -> dict:
    n = draw(st.sampled_from([1, 2, 3]))
    kernel = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    dilation = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    stride = draw(st.one_of(st.none(), st.lists(st.integers(1, 3), min_size=n, max_size=n)))
    padding = [draw(st.integers(0, k // 2)) for k in kernel]
    return dict(
        n=n,
        kwargs=dict(
            kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=draw(st.booleans())
        ),
        batch=draw(st.sampled_from([0, 2])),
        # small inputs make windows wider than the input: the division fallback
        size=[draw(st.integers(2, 10)) for _ in range(n)],
        chunk=draw(st.sampled_from([1 << 20, 7])),  # 7: the batch in several chunks
        dtype=draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16])),
        channels_last=draw(st.booleans()),
        seed=draw(st.integers(0, 999)),
    )


@settings(max_examples=50, deadline=None)
@given(case=pool_case())
def test_maxpool_matches_stock(case: dict) -> None:
    torch.manual_seed(case["seed"])
    n = case["n"]
    kw = case["kwargs"]
    for size, k, d, p in zip(case["size"], kw["kernel_size"], kw["dilation"], kw["padding"]):
        assume(size + 2 * p >= d * (k - 1) + 1)
    stock = POOL[n](**case["kwargs"])
    ours = twin(stock, MEMSAVE_LAYERS[type(stock)])
    shape = ([case["batch"]] if case["batch"] else []) + [3] + case["size"]
    x = torch.randn(shape, dtype=case["dtype"])
    if case["channels_last"] and case["batch"] and n > 1:
        x = x.to(memory_format=torch.channels_last if n == 2 else torch.channels_last_3d)
    a = run(stock, x, {"input": True})
    saved_chunk = pool._CHUNK_NUMEL
    pool._CHUNK_NUMEL = case["chunk"]
    try:
        b = run(ours, x, {"input": True})
    finally:
        pool._CHUNK_NUMEL = saved_chunk
    # backward runs stock's kernel on rebuilt int64 indices: bit-exact
    assert_same(a, b, exact_output=True, exact_grads=True)


def test_stride_defaults_to_kernel_and_return_indices_is_stock() -> None:
    stock = nn.MaxPool2d(3, return_indices=True)
    ours = twin(stock, MEMSAVE_LAYERS[nn.MaxPool2d])
    x = torch.randn(1, 2, 9, 9, requires_grad=True)
    (ya, ia), (yb, ib) = stock(x), ours(x)
    assert torch.equal(ya, yb) and torch.equal(ia, ib)
    assert MEMSAVE_LAYERS[nn.MaxPool2d](3)(x).shape == (1, 2, 3, 3)


@pytest.mark.parametrize("kernel,dtype", [(3, torch.uint8), (16, torch.uint8), (17, torch.int16)])
def test_maxpool_keeps_smallest_index_type(kernel: int, dtype: torch.dtype) -> None:
    assert window_index_dtype(kernel * kernel) == dtype
    layer = MEMSAVE_LAYERS[nn.MaxPool2d](kernel, stride=1)
    x = torch.randn(2, 3, kernel + 4, kernel + 4, requires_grad=True)
    out_numel = 2 * 3 * 5 * 5
    assert module_saved_bytes(layer, x) == out_numel * dtype.itemsize


def test_maxpool_stock_keeps_input_and_int64_indices() -> None:
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    assert module_saved_bytes(nn.MaxPool2d(2), x) == x.numel() * 4 + x.numel() // 4 * 8
