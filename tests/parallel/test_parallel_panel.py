"""The explorer's "GPUs" panel: controls build the spec; per-rank numbers come from measure_parallel."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from memsave_nb import Plan
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.ui.parallel_panel import ParallelPanel, spec_for

from .conftest import blocks_workload


def test_changing_the_gpu_count_updates_the_per_rank_numbers():
    wl = blocks_workload()
    plan = Plan(frozen=("blocks.0",))
    panel = ParallelPanel(wl, plan_fn=lambda: plan)
    panel.gpus.value = 2
    panel.wait(120)
    two = panel.result
    assert two.worst.peak_split == measure_parallel(wl, ParallelSpec(world_size=2), plan).worst.peak_split
    panel.gpus.value = 4
    panel.wait(120)
    four = panel.result
    assert four.spec.world_size == 4
    assert two.worst.end_split["sharded_parameters"] == 2 * four.worst.end_split["sharded_parameters"]
    assert "worst rank" in panel.peak.value and "FSDP2 x4" in panel.table.value and panel.error.value == ""


def test_bad_choice_shows_one_line_in_the_panel():
    panel = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(compile_budget=0.5), live=False)
    panel.refresh()
    assert "compile budget" in panel.error.value and panel.result is None


def test_spec_for_controls():
    assert spec_for(16, "hsdp", True) == ParallelSpec(
        world_size=16, replicate=2, param_dtype="bfloat16", reduce_dtype="float32"
    )
    assert spec_for(8, "fsdp-keep", False).reshard_after_forward is False


def test_explorer_has_a_gpus_tab_sizing_its_current_plan():
    from memsave_nb.session import Session
    from memsave_nb.ui.explorer import TAB_TITLES, Explorer

    wl = blocks_workload()
    ex = Explorer(Session(wl, repeats=0), live=False)
    gpus_tab = TAB_TITLES.index("GPUs")
    assert ex.tabs.children[gpus_tab] is ex.gpus and ex.tabs.get_title(gpus_tab) == "GPUs"
    ex.set_plan(Plan(frozen=("blocks.0",)))
    ex.gpus.gpus.value = 4
    ex.gpus.wait(120)
    expected = measure_parallel(wl, ParallelSpec(world_size=4), Plan(frozen=("blocks.0",)))
    assert ex.gpus.result.worst.end_split == expected.worst.end_split


def test_tensor_parallel_control_sizes_the_2d_layout():
    """The TP dropdown: TP 2 x FSDP2 2 on the zoo GPT, the numbers measure_parallel gives for that spec."""
    from memsave_nb import zoo

    wl = zoo.make("gpt", 2)
    panel = ParallelPanel(wl, plan_fn=lambda: Plan(), live=False)
    panel.gpus.value = 4
    panel.tp.value = 2
    panel.refresh()
    expected = measure_parallel(wl, ParallelSpec(world_size=4, tensor_parallel=2), Plan())
    assert panel.error.value == "", panel.error.value
    assert panel.result.spec.tensor_parallel == 2
    assert panel.result.worst.peak_split == expected.worst.peak_split
    assert "TP 2 x FSDP2 2" in panel.peak.value


def test_tensor_parallel_controls_build_the_spec_and_refuse_ddp():
    assert spec_for(8, "fsdp", False, tp=2, sequence_parallel=True) == ParallelSpec(
        world_size=8, tensor_parallel=2, sequence_parallel=True
    )
    assert spec_for(16, "hsdp", False, tp=4) == ParallelSpec(world_size=16, replicate=2, tensor_parallel=4)
    with pytest.raises(Exception, match="FSDP2 sharding"):
        spec_for(8, "ddp", False, tp=2)
    panel = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(), live=False)
    panel.sp.value = True  # sequence parallel without TP: one line in the panel, no old numbers
    panel.refresh()
    assert "need tensor_parallel &gt; 1" in panel.error.value and panel.result is None
