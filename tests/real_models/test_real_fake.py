"""Fake mode (no memory) counts the same bytes as real mode, on real Hugging Face / peft models."""

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


# Hugging Face decoders read values to pick their attention mask (packed positions, padding); fake
# tensors have none, so transformers would build a (B, 1, T, T) mask a real step skips and the
# regions would keep it (B*T*T bytes, 512 here). memsave_nb.measure.fake_compat answers those checks
# from the real batch: fake = real exactly on GPT-2, Llama and the LoRA Llama too.


def test_fake_mode_equals_real_mode_under_sac(case):
    """Sizing a checkpointed model without running it: fake mode agrees under SAC regions too."""
    plan = Plan(regions={b: "save_matmuls" for b in suggest_regions(case.model)})
    with plan.apply(case.workload) as applied:
        real = measure(applied, "real", repeats=0, flops=False)
    with plan.apply(case.workload) as applied:
        fake = measure(applied, "fake", flops=False)
    assert (fake.peak_bytes, fake.saved_bytes) == (real.peak_bytes, real.saved_bytes)
    assert fake.peak_split == real.peak_split
