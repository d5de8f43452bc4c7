"""Fake mode (FakeTensorMode: shapes, no memory, no compute) equals real mode to the byte on the CPU."""

from __future__ import annotations

from .conftest import measured


def test_fake_equals_real(case):
    real, fake = measured(case, "real"), measured(case, "fake")
    assert fake.mode == "fake" and fake.step_seconds is None
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_split == real.peak_split
    assert fake.end_of_forward == real.end_of_forward
    assert fake.saved_bytes == real.saved_bytes
    assert [(r.name, r.saved_bytes_own, r.saved_bytes, r.calls, r.output_shape) for r in fake.modules] == [
        (r.name, r.saved_bytes_own, r.saved_bytes, r.calls, r.output_shape) for r in real.modules
    ]
    assert fake.ops == real.ops
    assert fake.flops == real.flops
    assert fake.timeline.total() == real.timeline.total()
