"""On a CUDA device: the same call measures there and reports the allocator's peak beside the tracker's.

The comparison: the allocator's peak counts everything allocated on the device, measured from a
baseline taken after the batch is made; the tracker's peak counts tensor storages, parameters and
batch included. So ``cuda_peak_bytes - cuda_baseline_bytes + (parameters + inputs)`` is what the
tracker should see. The allocator rounds every block up to 512 bytes and cuBLAS / cuDNN take
workspaces no dispatch mode sees, so the two agree within a stated tolerance, not to the byte.
"""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure, zoo

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOLERANCE = 0.10  # 10% of the peak, plus a fixed allowance for library workspaces
WORKSPACE_BYTES = 64 * 2**20


@pytest.mark.parametrize("name,batch", [("mlp", 64), ("cnn", 16), ("gpt", 4)])
def test_tracker_peak_vs_allocator_peak(name, batch):
    m = measure(zoo.make(name, batch, device="cuda"), repeats=1)
    assert m.device.startswith("cuda") and m.cuda_peak_bytes is not None and m.cuda_baseline_bytes is not None
    preexisting = m.peak_split.parameters + m.peak_split.inputs
    allocator = m.cuda_peak_bytes - m.cuda_baseline_bytes + preexisting
    assert allocator >= m.peak_bytes * (1 - TOLERANCE)
    assert abs(allocator - m.peak_bytes) <= TOLERANCE * m.peak_bytes + WORKSPACE_BYTES
    assert m.step_seconds is not None and m.step_seconds > 0


def test_fake_mode_on_cuda_workload_equals_real_bytes():
    wl = zoo.make("mlp", 64, device="cuda")
    real, fake = measure(wl, repeats=0), measure(wl, "fake")
    assert fake.peak_bytes == real.peak_bytes and fake.saved_bytes == real.saved_bytes
