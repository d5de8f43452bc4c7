"""RMSNorm against torch.nn; what stock keeps for Linear, LayerNorm, RMSNorm, GELU, SiLU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes
from memsave_nb.layers import MemSaveRMSNorm


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    norm_dims=st.integers(1, 2),
    eps=st.sampled_from([None, 1e-5]),
    affine=st.booleans(),
    requires=st.tuples(st.booleans(), st.booleans()),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 999),
)
def test_rmsnorm_matches_stock(
    shape: list[int],
    norm_dims: int,
    eps: float | None,
    affine: bool,
    requires: tuple[bool, bool],
    dtype: torch.dtype,
    seed: int,
) -> None:
    norm_dims = min(norm_dims, len(shape))
    torch.manual_seed(seed)
    stock = nn.RMSNorm(shape[-norm_dims:], eps=eps, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            stock.weight.uniform_(0.5, 1.5)
    ours = twin(stock, MemSaveRMSNorm)
    x = torch.randn(shape, dtype=dtype)
    req = {"input": requires[0], "weight": requires[1]}
    assert_same(run(stock, x, req), run(ours, x, req), exact_output=True, exact_grads=False)


def test_rmsnorm_keeps_input_and_rstd_only() -> None:
    x = torch.randn(4, 6, 32, requires_grad=True)
    rows = 4 * 6
    assert module_saved_bytes(MemSaveRMSNorm(32), x) == x.numel() * 4 + rows * 4
    assert module_saved_bytes(nn.RMSNorm(32), x) == 2 * x.numel() * 4 + rows * 4


# What stock keeps, as multiples of the (float32) input, for each case of what needs a
# gradient: (input, weight) -> bytes kept / input bytes. These are the findings recorded in
# docs/layers.md; a change in a PyTorch release shows up here first.
STOCK_FINDINGS = [
    ("Linear", lambda: nn.Linear(32, 32), {(True, True): 1.0, (True, False): 0.0, (False, True): 1.0}),
    ("LayerNorm", lambda: nn.LayerNorm(32), {(True, True): 1.0625, (True, False): 1.0625, (False, True): 1.0625}),
    ("RMSNorm", lambda: nn.RMSNorm(32), {(True, True): 2.03125, (True, False): 1.03125, (False, True): 1.0}),
    ("GELU", lambda: nn.GELU(), {(True, None): 1.0}),
    ("GELU-tanh", lambda: nn.GELU("tanh"), {(True, None): 1.0}),
    ("SiLU", lambda: nn.SiLU(), {(True, None): 1.0}),
    # issue 11: the norms and activations of EfficientNet-, ConvNeXt- and MobileNet-shaped nets
    (
        "GroupNorm",
        lambda: nn.GroupNorm(4, 16),  # x, mean and rstd per (sample, group)
        {(True, True): 1.015625, (True, False): 1.015625, (False, True): 1.015625},
    ),
    (
        "InstanceNorm1d",
        lambda: nn.InstanceNorm1d(16),  # x, mean and invstd per (sample, ch.)
        {(True, None): 1.0625},
    ),
    (
        "InstanceNorm1d-affine",
        lambda: nn.InstanceNorm1d(16, affine=True),  # + the weight repeated
        {(True, True): 1.09375, (True, False): 1.09375, (False, True): 1.09375},
    ),
    ("Hardswish", lambda: nn.Hardswish(), {(True, None): 1.0}),
    ("Hardswish-inplace", lambda: nn.Hardswish(inplace=True), {(True, None): 1.0}),  # a clone
    ("SiLU-inplace", lambda: nn.SiLU(inplace=True), {(True, None): 1.0}),  # a clone of x
    ("Hardsigmoid", lambda: nn.Hardsigmoid(), {(True, None): 1.0}),  # 1 bit would do
]


@pytest.mark.parametrize("name,make,expected", STOCK_FINDINGS, ids=[f[0] for f in STOCK_FINDINGS])
def test_stock_keeps(name: str, make, expected: dict) -> None:
    for (req_x, req_w), ratio in expected.items():
        layer = make()
        if req_w is not None:
            layer.requires_grad_(req_w)
        x = torch.randn(8, 16, 32, requires_grad=req_x)
        assert module_saved_bytes(layer, x) == ratio * x.numel() * 4, (req_x, req_w)
