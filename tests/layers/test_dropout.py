"""Dropout: bit-exact against torch.nn under the same seed, 1 bit per element kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from layer_compare import assert_same, run, twin
from layer_counting import module_saved_bytes
from memsave_nb.layers import MemSaveDropout


@settings(max_examples=40, deadline=None)
@given(
    p=st.sampled_from([0.0, 0.1, 0.5, 0.77, 0.9, 1.0]),
    inplace=st.booleans(),
    training=st.booleans(),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 999),
)
def test_dropout_matches_stock(p: float, inplace: bool, training: bool, shape: list[int],
                               dtype: torch.dtype, seed: int) -> None:
    stock = nn.Dropout(p, inplace).train(training)
    ours = twin(stock, MemSaveDropout)
    x = torch.randn(shape, dtype=dtype)
    torch.manual_seed(seed)
    a = run(stock, x, {"input": True})
    torch.manual_seed(seed)
    b = run(ours, x, {"input": True})
    assert_same(a, b, exact_output=True, exact_grads=True)


@pytest.mark.parametrize("numel", [1, 9, 1000])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_one_bit_per_element(numel: int, p: float) -> None:
    x = torch.randn(numel, requires_grad=True)
    assert module_saved_bytes(MemSaveDropout(p), x) == -(-numel // 8)


def test_dropout_eval_is_identity_and_keeps_nothing() -> None:
    layer = MemSaveDropout(0.5).eval()
    x = torch.randn(100, requires_grad=True)
    assert torch.equal(layer(x), x)
    assert module_saved_bytes(layer, x) == 0
