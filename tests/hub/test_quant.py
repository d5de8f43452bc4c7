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
    return (
        (n + 1) // 2  # packed 4-bit weights, uint8
        + blocks  # absmax per 64-block, quantised to uint8
        + 4 * math.ceil(blocks / 256)  # float32 absmax of the absmax, per 256-block
        + 4 * 256  # float32 8-bit code of the second quantisation
        + 4  # float32 offset (mean absmax)
        + 4 * 16
    )  # float32 NF4 code


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
    params = bnb.nn.Params4bit(
        weight.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64
    )._quantize("cpu")
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


# -- which layers: the ones transformers' own bitsandbytes integration replaces -------------------
TINY = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "t5-base": dict(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16, num_heads=4, vocab_size=1000),
    "llama-3.2-1b": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    ),
}


def transformers_bnb_layers(name: str) -> dict[str, tuple[int, int]]:
    """``{module name: (in, out)}`` of the layers transformers' ``replace_with_bnb_linear`` makes 4-bit,
    with the skips its 4-bit quantiser passes (its defaults and ``_keep_in_fp32_modules``)."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import HfQuantizer

    from memsave_nb.hub import from_pretrained

    model = from_pretrained(name, overrides=TINY[name]).model  # the same build, no LoRA
    skip = HfQuantizer.get_modules_to_not_convert(model, None, model._keep_in_fp32_modules)
    replace_with_bnb_linear(model, skip, BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


@pytest.mark.parametrize("name", ["gpt2", "t5-base", "llama-3.2-1b"])
def test_qlora_quantises_the_layers_transformers_quantises(name):
    from memsave_nb.hub import from_pretrained

    theirs = transformers_bnb_layers(name)
    wl = from_pretrained(name, overrides=TINY[name], lora="r=4", quantize="nf4")
    ours = {
        n.removeprefix("base_model.model.").removesuffix(".base_layer"): (m.in_features, m.out_features)
        for n, m in wl.model.named_modules()
        if isinstance(m, QuantLinear)
    }
    assert ours == theirs
    assert len(ours) == {"gpt2": 8, "t5-base": 28, "llama-3.2-1b": 14}[name]  # GPT-2: 4 Conv1D a block; T5: not wo


def test_gpt2_conv1d_holds_bitsandbytes_own_storage_and_computes_the_layer():
    """A Conv1D (weight ``(in, out)``) quantised as transformers does: transposed, then Params4bit."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(96, 160)  # nf=96 outputs, nx=160 inputs: weight (160, 96)
    params = bnb.nn.Params4bit(
        conv.weight.detach().T.contiguous().to(torch.bfloat16),
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=True,
        blocksize=64,
    )._quantize("cpu")
    qs = params.quant_state
    theirs = [params.data, qs.absmax, qs.code, qs.state2.absmax, qs.state2.code, qs.offset]
    conv.requires_grad_(False)
    ours = QuantLinear(conv, "nf4")
    assert (ours.in_features, ours.out_features) == (160, 96)
    assert ours.storage_bytes() == sum(t.numel() * t.element_size() for t in theirs) == documented_nf4_bytes(96, 160)
    x = torch.randn(2, 3, 160)
    w = ours.dequantized(torch.float32)
    torch.testing.assert_close(ours(x), x @ w.T + conv.bias)
    assert ((w - conv.weight.T).abs() <= 0.2 * conv.weight.abs().amax()).all()  # within an NF4 step of the layer


def test_t5_qlora_measures_in_fake_mode():
    """Was ``'QuantLinear' object has no attribute 'weight'`` (T5 reads ``wo.weight.dtype``): ``wo``
    stays as transformers' quantiser leaves it (``_keep_in_fp32_modules``)."""
    from memsave_nb import measure
    from memsave_nb.hub import from_pretrained

    m = measure(
        from_pretrained("t5-base", overrides=TINY["t5-base"], lora="r=4", quantize="nf4", seq_len=32), mode="fake"
    )
    assert m.peak_bytes > 0
