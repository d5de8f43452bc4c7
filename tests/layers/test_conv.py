"""Convolutions: every option against torch.nn, and exactly what they keep."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes
from memsave_nb.layers import MEMSAVE_LAYERS

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
SPATIAL = {1: 9, 2: 7, 3: 5}
REQUIRES = st.tuples(st.booleans(), st.booleans(), st.booleans())
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16])


@st.composite
def conv_case(draw: st.DrawFn) -> dict:
    n = draw(st.sampled_from([1, 2, 3]))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    kernel = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    stride = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    dilation = draw(st.lists(st.integers(1, 2), min_size=n, max_size=n))
    kwargs = dict(
        in_channels=groups * draw(st.integers(1, 2)),
        out_channels=groups * draw(st.integers(1, 2)),
        kernel_size=kernel,
        stride=stride,
        dilation=dilation,
        groups=groups,
        bias=draw(st.booleans()),
    )
    forward_kwargs: dict = {}
    if transposed:
        kwargs["padding"] = draw(st.integers(0, 1))
        kwargs["output_padding"] = [draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation)]
        if draw(st.booleans()) and not any(kwargs["output_padding"]):
            forward_kwargs["output_size"] = "free"  # filled in below from the input size
    else:
        choices: list = [0, 1, 2, "valid"]
        if all(s == 1 for s in stride):
            choices.append("same")
        kwargs["padding"] = draw(st.sampled_from(choices))
        kwargs["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    batch = draw(st.sampled_from([0, 1, 2]))  # 0: unbatched input
    size = [SPATIAL[n] + draw(st.integers(0, 2)) for _ in range(n)]
    channels_last = n > 1 and batch > 0 and draw(st.booleans())
    return dict(
        n=n,
        transposed=transposed,
        kwargs=kwargs,
        forward_kwargs=forward_kwargs,
        batch=batch,
        size=size,
        channels_last=channels_last,
        dtype=draw(DTYPES),
        requires=draw(REQUIRES),
        seed=draw(st.integers(0, 999)),
    )


@settings(max_examples=60, deadline=None)
@given(case=conv_case())
def test_conv_matches_stock(case: dict) -> None:
    torch.manual_seed(case["seed"])
    n = case["n"]
    stock = (CONV_T if case["transposed"] else CONV)[n](**case["kwargs"]).to(case["dtype"])
    ours = twin(stock, MEMSAVE_LAYERS[type(stock)])
    shape = ([case["batch"]] if case["batch"] else []) + [case["kwargs"]["in_channels"]] + case["size"]
    x = torch.randn(shape, dtype=case["dtype"])
    if case["channels_last"]:
        x = x.to(memory_format=torch.channels_last if n == 2 else torch.channels_last_3d)
    fwd = dict(case["forward_kwargs"])
    if fwd.get("output_size") == "free":
        # one more than the minimum output size, which stride > 1 allows
        stride = case["kwargs"]["stride"]
        k, d, p = case["kwargs"]["kernel_size"], case["kwargs"]["dilation"], case["kwargs"]["padding"]
        fwd["output_size"] = [
            (i - 1) * s - 2 * p + dd * (kk - 1) + 1 + (1 if s > 1 else 0)
            for i, s, kk, dd in zip(case["size"], stride, k, d)
        ]
    req_x, req_w, req_b = case["requires"]
    requires = {"input": req_x, "weight": req_w, "bias": req_b}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = run(stock, x, requires, **fwd)
        b = run(ours, x, requires, **fwd)
    # Same forward kernel; backward runs with a shape-only stand-in for what was not kept,
    # which may pick another kernel: compare gradients within the dtype's tolerance.
    assert_same(a, b, exact_output=True, exact_grads=False)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(
    "req_x,req_w,req_b",
    [
        (True, True, True),
        (True, False, False),
        (True, False, True),
        (False, True, False),
        (False, False, True),
    ],
)
def test_conv_keeps_input_only_for_weight_grad(n: int, transposed: bool, req_x: bool, req_w: bool, req_b: bool) -> None:
    layer = (CONV_T if transposed else CONV)[n](4, 6, 3)
    ours = twin(layer, MEMSAVE_LAYERS[type(layer)])
    ours.weight.requires_grad_(req_w)
    ours.bias.requires_grad_(req_b)
    x = torch.randn(2, 4, *[SPATIAL[n]] * n).requires_grad_(req_x)
    # the weight is a parameter (never counted); the input copy x * 1 counts when kept
    expected = x.numel() * 4 if req_w else 0
    assert module_saved_bytes(ours, x) == expected


def test_conv_stock_keeps_input_even_when_weight_is_frozen() -> None:
    """The gap the layer closes (if stock ever stops doing this, the layer is redundant)."""
    layer = nn.Conv2d(4, 6, 3).requires_grad_(False)
    x = torch.randn(2, 4, 7, 7, requires_grad=True)
    assert module_saved_bytes(layer, x) == x.numel() * 4


def test_conv_transposed_rejects_padding_mode_like_stock() -> None:
    layer = nn.ConvTranspose2d(2, 2, 3)
    layer.padding_mode = "reflect"
    ours = twin(layer, MEMSAVE_LAYERS[nn.ConvTranspose2d])
    with pytest.raises(ValueError):
        ours(torch.randn(1, 2, 5, 5))


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: nn.Conv2d(8, 4, 1, stride=2, bias=False), (2, 8, 7, 9)),
        (lambda: nn.Conv2d(8, 4, 1), (2, 8, 7, 9)),
        (lambda: nn.Conv2d(8, 4, 1), (8, 7, 9)),
        (lambda: nn.Conv1d(8, 4, 1, stride=3), (2, 8, 10)),
        (lambda: nn.Conv3d(8, 4, 1, stride=2), (2, 8, 5, 4, 3)),
        (lambda: nn.ConvTranspose2d(8, 4, 1), (2, 8, 5, 5)),
        (lambda: nn.ConvTranspose2d(8, 4, 1, stride=2), (2, 8, 5, 5)),
    ],
    ids=["2d-s2", "2d", "2d-unbatched", "1d-s3", "3d-s2", "t2d", "t2d-s2"],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_pointwise_conv_input_grad(make, shape: tuple, channels_last: bool) -> None:
    """1x1 convolutions compute the input gradient as a matmul: check every stride layout."""
    stock = make()
    ours = twin(stock, MEMSAVE_LAYERS[type(stock)])
    x = torch.randn(shape)
    if channels_last and len(shape) == 4:
        x = x.to(memory_format=torch.channels_last)
    requires = {"input": True, "weight": False, "bias": True}
    b = run(ours, x, requires)
    a = run(stock, x, requires)
    assert_same(a, b, exact_output=True, exact_grads=False)


def test_frozen_conv_on_a_1x1_map_runs_stock() -> None:
    """Squeeze-excite's convs see a pooled (N, C, 1, 1) vector: stock keeps N x C numbers
    there, so the stock op runs (no Function call per layer); the gradients are stock's."""
    stock = nn.Conv2d(16, 4, 1)
    stock.requires_grad_(False)
    ours = twin(stock, MEMSAVE_LAYERS[nn.Conv2d])
    x = torch.randn(3, 16, 1, 1, requires_grad=True)
    out = ours(x)
    assert type(out.grad_fn).__name__ == "ConvolutionBackward0"
    requires = {"input": True, "weight": False, "bias": False}
    assert_same(run(stock, x, requires), run(ours, x, requires), exact_output=True, exact_grads=True)
    big = ours(torch.randn(3, 16, 2, 1, requires_grad=True))
    assert type(big.grad_fn).__name__ != "ConvolutionBackward0"  # ours where it saves bytes
