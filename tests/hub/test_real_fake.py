"""Small-shaped copies of catalogue models (same architecture and code path, fewer layers and width):
the fake-mode bytes of the meta build equal a real step's on random weights, for full fine-tuning,
LoRA and QLoRA; and the lora= path equals peft applied by hand, byte for byte."""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure
from memsave_nb.hub import from_pretrained

from .conftest import SMALL


def figures(m):
    return (m.peak_bytes, m.first_step_peak_bytes, m.saved_bytes, m.output_bytes, m.peak_split)


def pair(name, **kw):
    """The same workload twice: built on the meta device (measured fake) and with random weights (real)."""
    # sized_for=None: both run the CPU's step (a step sized for CUDA answers attention with CUDA's
    # kernels in fake mode only; docs/cuda_step.md)
    common = dict(batch_size=2, seq_len=32, overrides=SMALL[name], sized_for=None, **kw)
    return from_pretrained(name, **common), from_pretrained(name, empty_weights=False, **common)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fake_bytes_of_the_meta_build_equal_a_real_step(name):
    meta, real = pair(name)
    assert all(p.device.type == "meta" for p in meta.model.parameters())
    fake_m = measure(meta, "fake", flops=False)
    real_m = measure(real, "real", repeats=0, flops=False)
    assert figures(fake_m) == figures(real_m)
    assert fake_m.peak_split.parameters == sum(p.numel() * p.element_size() for p in real.model.parameters()) + sum(
        b.numel() * b.element_size() for b in real.model.buffers()
    )


@pytest.mark.parametrize(
    "kind",
    [dict(lora=dict(r=4)), dict(lora="r=4", quantize="nf4"), dict(lora="r=4", quantize="int8")],
    ids=["lora", "qlora-nf4", "qlora-int8"],
)
def test_fake_equals_real_with_lora_and_quantized_base(kind):
    meta, real = pair("llama-3.2-1b", **kind)
    assert figures(measure(meta, "fake", flops=False)) == figures(measure(real, "real", repeats=0, flops=False))


def test_lora_argument_equals_peft_by_hand_byte_for_byte():
    from peft import LoraConfig, get_peft_model

    name, overrides = "qwen2.5-0.5b", SMALL["qwen2.5-0.5b"]
    ours = from_pretrained(
        name,
        batch_size=2,
        seq_len=32,
        overrides=overrides,
        empty_weights=False,
        lora=dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    )
    plain = from_pretrained(name, batch_size=2, seq_len=32, overrides=overrides, empty_weights=False)
    by_hand = plain.replace(
        model=get_peft_model(
            plain.model,
            LoraConfig(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "v_proj"],
                modules_to_save=["lm_head"],
                task_type="CAUSAL_LM",
            ),
        )
    )
    trainable = lambda wl: [(n, p.shape) for n, p in wl.model.named_parameters() if p.requires_grad]  # noqa: E731
    assert trainable(ours) == trainable(by_hand) and len(trainable(ours)) == 2 * 2 * 2 + 1
    a, b = measure(ours, "real", repeats=0, flops=False), measure(by_hand, "real", repeats=0, flops=False)
    assert figures(a) == figures(b)
    assert a.timeline.by_category == b.timeline.by_category


def test_qlora_frozen_base_is_counted_as_its_storage():
    from memsave_nb.hub import QuantLinear

    meta, _ = pair("llama-3.2-1b", lora="r=4", quantize="nf4")
    quant = [m for m in meta.model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 2 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept in bf16
    expected = sum(m.storage_bytes() for m in quant) + sum(
        p.numel() * p.element_size() for p in meta.model.parameters()
    )
    m = measure(meta, "fake", flops=False)
    assert m.peak_split.parameters == expected + sum(
        b.numel() * b.element_size() for n, b in meta.model.named_buffers() if "inv_freq" in n
    )
    assert m.peak_split.gradients == 0 or m.peak_split.gradients <= sum(
        p.numel() * p.element_size() for p in meta.model.parameters() if p.requires_grad
    )
    head = meta.model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.bfloat16  # the head stays unquantised
