"""Fake mode (no memory) counts the same bytes as real mode, on real Hugging Face / peft models."""

import pytest

from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan


def test_fake_mode_equals_real_mode(case):
    real = measure(case.workload, "real", repeats=0, flops=False)
    fake = measure(case.workload, "fake", flops=False)
    assert real.saved_bytes > 0
    assert fake.peak_bytes == real.peak_bytes
    assert fake.saved_bytes == real.saved_bytes
    assert fake.peak_split == real.peak_split
    assert [(r.name, r.saved_bytes) for r in fake.modules] == [(r.name, r.saved_bytes) for r in real.modules]


# Hugging Face decoders build their causal mask differently under fake tensors: on real tensors they
# read the padding mask (`aten.all`), see no padding and pass no mask to SDPA (`is_causal=True`);
# on fake tensors `transformers.utils.import_utils.is_tracing` is True, so they materialise a
# (B, T, T) bool mask. It reaches every block as an argument, so a checkpointed region keeps it:
# fake mode reports B*T*T bytes (512 here) more saved than the real step. Left to the engine (fake
# mode would have to take the real path); strict, so the fix shows here.
MASK_UNDER_FAKE = {"gpt2", "llama", "lora-llama"}


def test_fake_mode_equals_real_mode_under_sac(case, request):
    """Sizing a checkpointed model without running it: fake mode agrees under SAC regions too."""
    if case.name in MASK_UNDER_FAKE:
        request.applymarker(pytest.mark.xfail(strict=True, reason="HF materialises the causal mask under fake tensors"))
    plan = Plan(regions={b: "save_matmuls" for b in suggest_regions(case.model)})
    with plan.apply(case.workload) as applied:
        real = measure(applied, "real", repeats=0, flops=False)
    with plan.apply(case.workload) as applied:
        fake = measure(applied, "fake", flops=False)
    assert (fake.peak_bytes, fake.saved_bytes) == (real.peak_bytes, real.saved_bytes)
