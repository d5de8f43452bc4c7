"""measure() on a torch.compile'd model goes to the profiler-based counter, not the dispatch tracker
(inside a compiled graph allocations never reach Python dispatch)."""

import pytest
import torch
from torch import nn

from memsave_nb import Workload, WorkloadError, measure


def _workload(model: nn.Module) -> Workload:
    torch.manual_seed(0)
    return Workload(model, torch.randn(64, 256), optimizer=None)


def test_compiled_model_is_measured_from_profiler_events():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))
    eager = measure(_workload(model), repeats=0)
    compiled = measure(_workload(torch.compile(model, backend="aot_eager")), repeats=1)
    assert compiled.compiled and not eager.compiled
    # Same step, same tensors kept: tanh output (64x512 fp32) + the output; parameters equal.
    assert compiled.peak_split.parameters == eager.peak_split.parameters
    assert compiled.saved_bytes == pytest.approx(eager.saved_bytes, rel=0.05)
    assert compiled.peak_bytes == pytest.approx(eager.peak_bytes, rel=0.05)


def test_compiled_model_in_fake_mode_is_a_clear_error():
    model = torch.compile(nn.Linear(4, 4), backend="aot_eager")
    with pytest.raises(WorkloadError, match="fake mode"):
        measure(Workload(model, torch.randn(2, 4), optimizer=None), mode="fake")
