"""Batch norm in every mode against torch.nn, and what it keeps in eval mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes
from memsave_nb.layers import MEMSAVE_LAYERS

BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from([1, 2, 3]),
    affine=st.booleans(),
    track=st.booleans(),
    momentum=st.sampled_from([None, 0.1, 0.5]),
    training=st.booleans(),
    requires=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    channels_last=st.booleans(),
    seed=st.integers(0, 999),
)
def test_batchnorm_matches_stock(
    n: int,
    affine: bool,
    track: bool,
    momentum: float | None,
    training: bool,
    requires: tuple[bool, bool, bool],
    dtype: torch.dtype,
    channels_last: bool,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    stock = BN[n](3, affine=affine, track_running_stats=track, momentum=momentum).to(dtype)
    with torch.no_grad():
        for t in (stock.weight, stock.bias):
            if t is not None:
                t.uniform_(0.5, 1.5)
        if track:
            stock.running_mean.uniform_(-1, 1)
            stock.running_var.uniform_(0.5, 2)
    stock.train(training)
    ours = twin(stock, MEMSAVE_LAYERS[type(stock)])
    shape = [4, 3] + ([5] if n == 1 else [4] * n)
    x = torch.randn(shape, dtype=dtype)
    if channels_last and n > 1:
        x = x.to(memory_format=torch.channels_last if n == 2 else torch.channels_last_3d)
    req = {"input": requires[0], "weight": requires[1], "bias": requires[2]}
    for step in range(2):  # two steps: running stats, momentum=None averaging, batch count
        a = run(stock, x + step, req)
        b = run(ours, x + step, req)
        # eval + frozen weight computes the input gradient from the kept scale: tolerance
        assert_same(a, b, exact_output=True, exact_grads=False)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm_eval_frozen_keeps_one_scale_per_channel(n: int, affine: bool) -> None:
    layer = MEMSAVE_LAYERS[BN[n]](5, affine=affine).eval()
    layer.requires_grad_(False)
    x = torch.randn([2, 5] + [4] * n, requires_grad=True)
    assert module_saved_bytes(layer, x) == 5 * 4  # float32 per-channel scale


def test_batchnorm_eval_trainable_bias_only_keeps_scale() -> None:
    layer = MEMSAVE_LAYERS[nn.BatchNorm2d](5).eval()
    layer.weight.requires_grad_(False)
    x = torch.randn(2, 5, 4, 4, requires_grad=True)
    assert module_saved_bytes(layer, x) == 5 * 4


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_keeps_input_when_it_must(training: bool) -> None:
    """Training mode needs the input for the input gradient, a trainable weight for its own."""
    layer = MEMSAVE_LAYERS[nn.BatchNorm2d](5).train(training)
    x = torch.randn(2, 5, 4, 4, requires_grad=True)
    stock = module_saved_bytes(nn.BatchNorm2d(5).train(training), x)
    assert module_saved_bytes(layer, x) == stock >= x.numel() * 4


def test_batchnorm_stock_keeps_input_in_eval_with_frozen_weight() -> None:
    layer = nn.BatchNorm2d(5).eval().requires_grad_(False)
    x = torch.randn(2, 5, 4, 4, requires_grad=True)
    assert module_saved_bytes(layer, x) >= x.numel() * 4


def test_batchnorm_num_batches_tracked_advances() -> None:
    layer = MEMSAVE_LAYERS[nn.BatchNorm2d](3)
    for _ in range(3):
        layer(torch.randn(2, 3, 4, 4, requires_grad=True)).sum().backward()
    assert int(layer.num_batches_tracked) == 3
