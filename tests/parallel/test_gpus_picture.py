"""The GPUs tab as a per-rank picture (issue 28, item 4), without a browser: a stacked bar per
distinct rank group whose segments are the measured categories, the unseen lines as a hatched
range above, the usable line and a verdict from the Fit-a-GPU target, a table with units chosen
per value (DDP's replica not called "sharded"), and nothing of an old result left under an error."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from memsave_nb import Plan
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.session import Session
from memsave_nb.target import Target, replay_line_bytes
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.parallel_panel import ParallelPanel

from .conftest import blocks_workload


def test_bars_line_verdict_and_table_follow_the_target():
    wl = blocks_workload()
    ex = Explorer(Session(wl, mode="fake", repeats=0), live=False)
    panel = ex.gpus
    panel.live = False
    panel.gpus.value = 4
    panel.refresh()
    expected = measure_parallel(wl, ParallelSpec(world_size=4), ex.plan)
    worst = expected.worst
    fig = panel.figure
    # one bar per distinct rank group; each category's segment is the measured split
    labels = list(fig.x_range.factors)
    assert len(labels) == len(expected.ranks) >= 1
    source = fig.select_one({"name": "gpus_unseen"}).data_source
    for c, v in worst.peak_split.items():
        if v:
            assert fig.select_one({"name": f"gpus_bar_{c}"}) is not None
            assert source.data[c][[r.rank for r in expected.ranks].index(worst.rank)] == v
    k = [r.rank for r in expected.ranks].index(worst.rank)
    assert source.data["unseen_bottom"][k] == worst.peak_bytes
    assert source.data["unseen_top"][k] - worst.peak_bytes > 300 * 2**20  # the CUDA context at least
    assert fig.select_one({"name": "gpus_unseen"}).glyph.hatch_pattern == "/"
    # the explorer's target (set in Fit a GPU) draws the line and the verdict; every rank was replayed
    # through the allocator model, so the line is the whole GPU less the CUDA context and the NCCL
    # buffers, and the verdict is the replay's (predicted reserved + context + buffers), no 80% rule
    ex.tuner.set_target(16)
    assert ex.target is not None
    line = panel.figure.select_one({"name": "gpus_usable_line"})
    n = expected.spec.communicators
    assert (
        line is not None and line.location == replay_line_bytes(Target(16), n) == 16 * 2**30 - (500 + 512 * n) * 2**20
    )
    deciding = max(expected.ranks, key=lambda r: r.reserved.max_reserved_bytes)
    reserved = deciding.reserved.max_reserved_bytes
    assert reserved >= deciding.peak_bytes
    assert (
        "memsave-fits" in panel.verdict.value and f"predicted reserved {format_bytes(reserved)}" in panel.verdict.value
    )
    assert (
        panel.verdict.value.count("memsave-parallel-replay") == 1 and "memsave-parallel-rule" not in panel.verdict.value
    )
    # the hatched range holds the replay's excess over the counted peak, not the 80% rule's quarter
    assert source.data["unseen_top"][k] - worst.peak_bytes < 2 * 2**30
    assert panel.figure.y_range.end >= line.location
    fixed = (500 + 512 * n) * 2**20
    needed = reserved + fixed
    short = (deciding.reserved.max_allocated_bytes - 1 + fixed) / 2**30  # under the allocations' peak
    ex.tuner.set_target(short)
    assert "memsave-nofit" in panel.verdict.value and "does not fit" in panel.verdict.value
    ex.tuner.set_target(needed / 2**30)
    assert "memsave-fits" in panel.verdict.value
    # the table: a real table, whole column names, units chosen per value
    table = panel.table.value
    assert "<table" in table and "<pre" not in table
    assert "parameters (shards)" in table and "sharded_parame" not in table
    for v in worst.peak_split.values():
        if v:
            assert f">{format_bytes(v)}<" in table


def test_ddp_replica_is_not_sharded_and_an_error_clears_the_old_result():
    wl = blocks_workload()
    panel = ParallelPanel(wl, plan_fn=lambda: Plan(), live=False)
    panel.gpus.value, panel.sharding.value = 2, "ddp"
    panel.refresh()
    assert "parameters (replica)" in panel.table.value and "parameters (shards)" not in panel.table.value
    assert panel.figure is not None and panel.figure_box.children
    panel.offload.value = True  # CPU offload under DDP: an error
    panel.refresh()
    assert "CPU offload" in panel.error.value
    assert panel.table.value == "" and panel.peak.value == "" and panel.verdict.value == ""
    assert panel.figure_box.children == () and panel.result is None
