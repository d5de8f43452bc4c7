"""torch.compile with an activation memory budget, measured from the profiler's memory events.

Compiles are slow on a small CPU: a tiny model, two budgets."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.measure.compiled import measure_compiled, original_model
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.session import Session, sweep_budgets
from memsave_nb.workload import Workload
from plan_cases import gradients

pytestmark = pytest.mark.slow


def tiny() -> Workload:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
        x = torch.randn(64, 32)
    return Workload(model, x, optimizer="adamw", name="tiny")


def test_profiler_measurement_agrees_with_the_engine_on_an_eager_step():
    workload = tiny()
    engine = measure(workload, repeats=0, flops=False)
    profiled = measure_compiled(workload, repeats=0, warmup=0)
    assert profiled.saved_bytes == engine.saved_bytes
    for category in ("parameters", "inputs", "gradients", "optimizer_state", "activations"):
        assert getattr(profiled.peak_split, category) == getattr(engine.peak_split, category), category
    assert abs(profiled.peak_bytes - engine.peak_bytes) <= 64  # the allocator's own bookkeeping
    assert not profiled.compiled and profiled.module("").saved_bytes == profiled.saved_bytes


def test_budget_zero_keeps_less_than_budget_one_and_gradients_hold():
    workload = tiny()
    before = ModelSnapshot.capture(workload.model)
    reference = gradients(workload, Plan())
    points = sweep_budgets(workload, budgets=(1.0, 0.0), repeats=1)
    assert [p.budget for p in points] == [1.0, 0.0]
    one, zero = points
    assert zero.saved_bytes < one.saved_bytes
    assert zero.step_seconds is not None and zero.peak_bytes > 0
    assert before.differences(workload.model) == []
    assert functorch_config.activation_memory_budget == 1.0  # the config is restored
    got = gradients(workload, Plan(compile_budget=0.0))
    assert set(got) == set(reference)
    for name in reference:
        torch.testing.assert_close(got[name], reference[name], rtol=1e-4, atol=1e-6)
    assert before.differences(workload.model) == []


def test_compiled_plan_in_a_session_and_as_code():
    workload = tiny()
    session = Session(workload, repeats=1)
    plan = Plan(frozen="0", compile_budget=0.0)
    entry = session.run(plan)
    assert entry.measurement.compiled
    assert entry.measurement.saved_bytes < session.baseline.saved_bytes
    # the exported snippet, run on a fresh copy, keeps the same bytes
    fresh = tiny()
    namespace = {"model": fresh.model}
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=1.0):  # the snippet sets it globally
        exec(compile(plan.to_code(), "<plan>", "exec", dont_inherit=True), namespace)
        scripted = measure_compiled(fresh.replace(model=namespace["model"]), repeats=0)
    torch._dynamo.reset()
    assert original_model(namespace["model"]) is fresh.model
    assert scripted.saved_bytes == entry.measurement.saved_bytes


def test_gpt_budget_zero_keeps_less_than_budget_one():
    """The issue's ordering on the GPT-style demo (a small config: two compiles on a small CPU)."""
    from plan_cases import TINY_GPT

    from memsave_nb import zoo

    config = TINY_GPT.__class__(**{**TINY_GPT.__dict__, "dropout": 0.0})
    workload = zoo.gpt(config, batch_size=2)
    before = ModelSnapshot.capture(workload.model)
    one, zero = sweep_budgets(workload, budgets=(1.0, 0.0), repeats=0)
    assert zero.saved_bytes < one.saved_bytes
    assert before.differences(workload.model) == []


def test_compiled_plan_with_regions_restores_after_a_failing_step():
    workload = tiny()
    before = ModelSnapshot.capture(workload.model)
    plan = Plan(frozen="0", regions={"2": "save_matmuls"}, compile_budget=0.5)

    def boom(module, args):
        raise RuntimeError("simulated out of memory")

    with pytest.raises(Exception, match="simulated out of memory"):
        with plan.apply(workload) as applied:
            assert original_model(applied.model) is workload.model
            workload.model[3].register_forward_pre_hook(boom)
            measure_compiled(applied, repeats=0, warmup=0)
    assert before.differences(workload.model) == []
    assert all("forward" not in vars(m) for m in workload.model.modules())
    assert functorch_config.activation_memory_budget == 1.0


def test_checkpointed_regions_compile_and_keep_less():
    """Regions and a budget together: dynamo traces the non-reentrant checkpoint (full: no
    context_fn; selective: the SAC context) and the compiled step keeps less than compile alone."""
    from memsave_nb.session import run_plan

    workload = tiny()
    alone = run_plan(workload, Plan(compile_budget=1.0), repeats=0)
    full = run_plan(workload, Plan(regions={"0": "full", "2": "full"}, compile_budget=1.0), repeats=0)
    selective = run_plan(workload, Plan(regions={"0": "save_matmuls"}, compile_budget=1.0), repeats=0)
    assert full.compiled and selective.compiled
    assert full.saved_bytes < alone.saved_bytes
    assert selective.saved_bytes <= alone.saved_bytes
