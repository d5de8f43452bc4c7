"""Mixture-of-experts (a Mixtral-style model from a small config): the experts' grouped matmuls are
matmuls for the presets that keep matmuls, and fake mode sizes a float32 step as a real one runs it."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

from .real_cases import HEADS, HIDDEN, LAYERS, SEQ, VOCAB, _ids, _transformers

GROUPED = "aten._grouped_mm"


def _mixtral(dtype: torch.dtype = torch.float32) -> Workload:
    t = _transformers()
    if not hasattr(torch.ops.aten, "_grouped_mm"):
        pytest.skip("this torch has no grouped matmul")
    cfg = t.MixtralConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2 * SEQ,
    )
    torch.manual_seed(0)
    model = t.MixtralForCausalLM(cfg).to(dtype).train()
    ids = _ids()
    return Workload(model, {"input_ids": ids, "labels": ids}, name="mixtral")


def _grouped_saved(m) -> int:
    return sum(o.saved_bytes for o in m.ops if o.op == GROUPED)


@pytest.mark.parametrize("preset", ["save_matmuls", "save_compute_intensive"])
def test_presets_keeping_matmuls_keep_the_experts_matmuls(preset):
    wl = _mixtral()
    plain = measure(wl, "real", repeats=0, flops=False)
    assert _grouped_saved(plain) > 0  # the oracle: eager keeps the experts' matmul outputs for backward
    with Plan(regions={b: preset for b in suggest_regions(wl.model)}).apply(wl) as applied:
        kept = measure(applied, "real", repeats=0, flops=False)
    assert _grouped_saved(kept) == _grouped_saved(plain)  # before: 0, the experts recomputed in full
    with Plan(regions={b: "full" for b in suggest_regions(wl.model)}).apply(wl) as applied:
        full = measure(applied, "real", repeats=0, flops=False)
    assert kept.saved_bytes > full.saved_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("regions", [None, "save_matmuls"])
def test_fake_mode_sizes_mixtral_as_a_real_step(dtype, regions):
    """PyTorch's meta kernel for grouped matmuls takes bfloat16 only; a real CPU step runs float32."""
    wl = _mixtral(dtype)
    plan = Plan(regions={b: regions for b in suggest_regions(wl.model)}) if regions else Plan()
    with plan.apply(wl) as applied:
        real = measure(applied, "real", repeats=0, flops=False)
        fake = measure(applied, "fake", repeats=0, flops=False)
    assert (fake.peak_bytes, fake.saved_bytes) == (real.peak_bytes, real.saved_bytes)
    assert _grouped_saved(fake) == _grouped_saved(real)
    assert not _our_fake_rules()  # the override is gone after the step


def _our_fake_rules() -> list:
    from torch._subclasses import fake_impls

    return [
        c
        for c, _ in fake_impls.op_implementations_checks
        if (getattr(c, "__module__", None) or "").startswith("memsave_nb")
    ]
