"""Fake mode (no memory) counts the same bytes as real mode, on real Hugging Face / peft models."""

from memsave_nb.measure import measure


def test_fake_mode_equals_real_mode(case):
    real = measure(case.workload, "real", repeats=0, flops=False)
    fake = measure(case.workload, "fake", flops=False)
    assert real.saved_bytes > 0
    assert fake.peak_bytes == real.peak_bytes
    assert fake.saved_bytes == real.saved_bytes
    assert fake.peak_split == real.peak_split
    assert [(r.name, r.saved_bytes) for r in fake.modules] == [(r.name, r.saved_bytes) for r in real.modules]
