"""QLoRA's frozen base: the stand-in holds exactly bitsandbytes' bytes (its own classes where it is
installed, its documented layout always) and computes a linear layer with the dequantised weight."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from memsave_nb.hub.quant import QuantLinear

SHAPES = [(128, 256), (100, 70), (4096, 14336 // 64)]


def documented_nf4_bytes(rows: int, cols: int) -> int:
    """bitsandbytes 4-bit, blocksize 64, double quantisation (functional.quantize_4bit)."""
    n = rows * cols
    blocks = math.ceil(n / 64)
    return ((n + 1) // 2  # packed 4-bit weights, uint8
            + blocks  # absmax per 64-block, quantised to uint8
            + 4 * math.ceil(blocks / 256)  # float32 absmax of the absmax, per 256-block
            + 4 * 256  # float32 8-bit code of the second quantisation
            + 4  # float32 offset (mean absmax)
            + 4 * 16)  # float32 NF4 code


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_storage_is_the_documented_layout(shape, device):
    rows, cols = shape
    q = QuantLinear(nn.Linear(cols, rows, bias=False, device=device, dtype=torch.bfloat16), "nf4")
    assert q.storage_bytes() == documented_nf4_bytes(rows, cols)
    assert q.packed.dtype == q.absmax_q.dtype == torch.uint8
    q8 = QuantLinear(nn.Linear(cols, rows, bias=False, device=device), "int8")
    assert q8.storage_bytes() == rows * cols + 4 * rows  # int8 weights and a float32 scale per row (SCB)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_storage_equals_bitsandbytes_own_classes(shape):
    bnb = pytest.importorskip("bitsandbytes")
    rows, cols = shape
    weight = torch.randn(rows, cols, dtype=torch.bfloat16)
    params = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True,
                               blocksize=64)._quantize("cpu")
    qs = params.quant_state
    theirs = [params.data, qs.absmax, qs.code, qs.state2.absmax, qs.state2.code, qs.offset]
    theirs_bytes = sum(t.numel() * t.element_size() for t in theirs)
    ours = QuantLinear(nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16), "nf4")
    assert ours.storage_bytes() == theirs_bytes == documented_nf4_bytes(rows, cols)
    int8 = bnb.nn.Int8Params(weight.float().clone(), requires_grad=False, has_fp16_weights=False)._quantize("cpu")
    theirs8 = int8.data.numel() * int8.data.element_size() + int8.SCB.numel() * int8.SCB.element_size()
    assert QuantLinear(nn.Linear(cols, rows, bias=False), "int8").storage_bytes() == theirs8


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_forward_and_backward_use_the_dequantised_weight(quant_type):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, dtype=torch.float32)
    q = QuantLinear(linear, quant_type)
    w = q.dequantized(torch.float32)
    assert w.shape == linear.weight.shape
    # quantisation error within one NF4 step (about 1/8 of a block's absmax) or one int8 step
    tolerance = 0.2 if quant_type == "nf4" else 1 / 127
    assert ((w - linear.weight).abs() <= tolerance * linear.weight.abs().amax() + 1e-6).all()
    x = torch.randn(3, 5, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, ref = q(x), nn.functional.linear(x_ref, w, linear.bias)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert not any(p.requires_grad for p in q.parameters())
