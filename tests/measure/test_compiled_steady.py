"""The profiler-based counter (compiled models) measures what the engine measures: training's
steady state by default, accumulation over k micro-steps, grads kept as zeros or set to None.

The oracle is the dispatch-level engine on the same eager step: both count the same allocations
in two independent ways (profiler memory events against tracked storages)."""

import pytest
import torch
from torch import nn

from memsave_nb import Workload, measure
from memsave_nb.measure.compiled import measure_compiled

pytestmark = pytest.mark.slow

CATEGORIES = ("parameters", "inputs", "gradients", "optimizer_state", "activations", "outputs")


def tiny(**fields) -> Workload:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
        x = torch.randn(64, 32)
    return Workload(model, x, optimizer="adamw", name="tiny", **fields)


@pytest.mark.parametrize(
    "fields",
    [{}, {"accumulation_steps": 3}, {"set_to_none": False}, {"accumulation_steps": 2, "set_to_none": False}],
    ids=["default", "accumulate3", "keep-zero-grads", "accumulate2-keep"],
)
def test_profiler_counter_equals_the_engine_in_steady_state(fields):
    workload = tiny(**fields)
    engine = measure(workload, repeats=0, flops=False, first_step_peak=True)
    assert measure(workload, repeats=0, flops=False).peak_split == engine.peak_split  # one tracked step
    profiled = measure_compiled(workload, repeats=0, warmup=0)
    assert profiled.steady_state and engine.steady_state
    # loss / k saves the wrapped number k (a 0-d float64, 8 bytes) for backward: real memory that
    # the profiler sees and the engine's saved-tensor hooks (around forward and loss) do not
    scalar = 8 if workload.accumulation_steps > 1 else 0
    assert profiled.saved_bytes == engine.saved_bytes + scalar
    for category in CATEGORIES:
        extra = scalar if category == "activations" else 0
        assert getattr(profiled.peak_split, category) in (
            getattr(engine.peak_split, category),
            getattr(engine.peak_split, category) + extra,
        ), category
    assert abs(profiled.peak_bytes - engine.peak_bytes) <= 64
    assert abs(profiled.first_step_peak_bytes - engine.first_step_peak_bytes) <= 64


def test_steady_state_counts_the_optimizer_state_from_the_start():
    workload = tiny()
    params = sum(p.numel() * 4 for p in workload.model.parameters())
    steps = 4 * len(list(workload.model.parameters()))  # one 0-d float32 step count per parameter
    first = measure_compiled(workload, repeats=0, warmup=0, steady_state=False)
    steady = measure_compiled(workload, repeats=0, warmup=0)
    assert not first.steady_state and first.first_step_peak_bytes == first.peak_bytes
    # AdamW's exp_avg and exp_avg_sq: two fp32 copies of every parameter, alive before step 2 begins
    assert steady.timeline.by_category["optimizer_state"][0] == 2 * params + steps
    assert first.timeline.by_category["optimizer_state"][0] == 0
    assert steady.first_step_peak_bytes == pytest.approx(first.peak_bytes, abs=64)


def test_a_compiled_model_is_measured_in_steady_state_through_measure():
    workload = tiny()
    eager = measure(workload, repeats=0, flops=False)
    compiled = measure(workload.replace(model=torch.compile(workload.model, backend="aot_eager")), repeats=0)
    assert compiled.compiled and compiled.steady_state
    assert compiled.peak_split.optimizer_state == eager.peak_split.optimizer_state
    assert compiled.peak_bytes == pytest.approx(eager.peak_bytes, rel=0.05)
