"""The layout planner started from a plan (planner/start_plan.py): the plan's choices on every
candidate, the lower bound and the depth extrapolation under them, and plans it cannot start from
refused in one line."""

from __future__ import annotations

import pytest

from memsave_nb.checkpointing import PlanError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.parallel import measure_parallel
from memsave_nb.plan import Plan
from memsave_nb.planner.layout import plan_layout
from memsave_nb.target import Target

from test_layout import MIB, _gpt

TARGET = Target(2 * MIB / 2**30, headroom=1.0)


@pytest.mark.slow
def test_a_frozen_plan_is_extrapolated_over_its_blocks_and_remeasured_exactly():
    """Six blocks, every block's attention frozen (alike): measured at 3 and 4 blocks under the plan
    and extrapolated; the chosen layout's re-measurement at full depth (the plan applied) equals the
    shallow check of its micro-batch, and the lower bound counted the frozen weights as frozen."""
    wl = _gpt(6, batch=2)
    before = ModelSnapshot.capture(wl.model)
    plan = Plan(frozen=("blocks.*.attn.*",), loss="chunked")
    r = plan_layout(
        wl, 4, "H100", TARGET, tensor_parallel=(1,), region_kinds=(None, "full"), max_micro_batches=2, plan=plan
    )
    assert r.chosen is not None and r.remeasured is not None
    assert not any("full depth" in n for n in r.notes) and any(
        "starts from the plan: freeze blocks.*.attn.*" in n for n in r.notes
    )
    assert all(c.plan.frozen == plan.frozen and c.plan.loss == "chunked" for c in r.candidates)
    assert r.remeasured.device_peak_bytes == r.chosen.checked_peak_bytes
    m = measure_parallel(
        wl,
        r.chosen.spec,
        r.chosen.plan.replace(accumulation_steps=min(r.chosen.accumulation, 2) if r.chosen.accumulation > 1 else None),
    )
    assert m.device_peak_bytes == r.remeasured.device_peak_bytes
    assert before.differences(wl.model) == []


@pytest.mark.slow
def test_a_plan_that_treats_one_block_apart_is_measured_at_full_depth():
    wl = _gpt(6, batch=2)
    r = plan_layout(
        wl,
        2,
        "H100",
        Target(64, headroom=1.0),
        tensor_parallel=(1,),
        region_kinds=(None,),
        remeasure=False,
        plan=Plan(frozen=("blocks.5",)),
    )
    assert any("the plan treats some blocks differently" in n for n in r.notes)
    assert r.chosen is not None and r.chosen.plan.frozen == ("blocks.5",)


def test_the_plans_checkpointing_precision_and_batch_are_kept():
    wl = _gpt(2, batch=4)
    plan = Plan(regions={"blocks.0": "save_matmuls", "blocks.1": "save_matmuls"}, batch_size=2, accumulation_steps=2)
    r = plan_layout(wl, 2, "H100", Target(64, headroom=1.0), tensor_parallel=(1,), remeasure=False, plan=plan)
    assert {c.regions for c in r.candidates} == {"save_matmuls"}
    assert r.global_batch == 2 * 2 * 2  # the plan's batch x accumulation per GPU, on 2 GPUs


@pytest.mark.parametrize(
    "plan,message",
    [
        (Plan(regions={"blocks.0": "full"}), "every block is checkpointed alike"),
        (Plan(compile_budget=0.5), "compile budget cannot be sized per rank"),
        (Plan(frozen=("nope",)), "plan frozen: 'nope' names no parameter or module"),
        ("freeze", "plan must be a memsave_nb.Plan"),
    ],
)
def test_a_plan_it_cannot_start_from_is_one_line(plan, message):
    wl = _gpt(2)
    with pytest.raises(PlanError) as info:
        plan_layout(wl, 4, "H100", TARGET, plan=plan)
    assert message in str(info.value) and "\n" not in str(info.value)
