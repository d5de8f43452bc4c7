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
from memsave_nb.target import Target
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
    # the explorer's target (set in Fit a GPU) draws the usable line and the verdict
    ex.tuner.set_target(16)
    assert ex.target is not None
    line = panel.figure.select_one({"name": "gpus_usable_line"})
    assert line is not None and line.location == Target(16).usable_bytes
    assert "memsave-fits" in panel.verdict.value and format_bytes(worst.peak_bytes) in panel.verdict.value
    # per-rank steps carry no allocator replay: the tab says its rule in one line rather than invent one
    assert (
        panel.verdict.value.count("memsave-parallel-rule") == 1
        and "80% rule: the per-rank steps" in panel.verdict.value
    )
    assert panel.figure.y_range.end >= line.location
    tiny = worst.peak_bytes * 0.9 / 0.8 / 2**30  # just under: does not fit
    ex.tuner.set_target(tiny)
    assert "memsave-nofit" in panel.verdict.value and "does not fit" in panel.verdict.value
    assert panel.figure.select_one({"name": "gpus_usable_line"}).location == Target(tiny).usable_bytes
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
