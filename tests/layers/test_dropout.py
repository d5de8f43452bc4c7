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
def test_dropout_matches_stock(
    p: float, inplace: bool, training: bool, shape: list[int], dtype: torch.dtype, seed: int
) -> None:
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


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_device_path_matches_native_dropout(inplace: bool, monkeypatch) -> None:
    """The CUDA path (stock's fused ``native_dropout``), run on the CPU: same draw, same
    gradient as ``native_dropout`` / ``native_dropout_backward``, 1 bit kept."""
    import importlib

    dropout_module = importlib.import_module("memsave_nb.layers.dropout")

    monkeypatch.setattr(dropout_module, "_FUSED_DEVICES", {"cpu"})
    x = torch.randn(7, 9)
    g = torch.randn(7, 9)
    torch.manual_seed(5)
    ref_out, ref_mask = torch.native_dropout(x, 0.3, True)
    ref_grad = torch.ops.aten.native_dropout_backward(g, ref_mask, 1 / 0.7)
    torch.manual_seed(5)
    leaf = x.clone().requires_grad_(True)
    out = MemSaveDropout(0.3, inplace)(leaf * 1)
    (grad,) = torch.autograd.grad(out, leaf, g)
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    torch.manual_seed(5)
    assert module_saved_bytes(MemSaveDropout(0.3, inplace), x.requires_grad_(True)) == -(-63 // 8)
