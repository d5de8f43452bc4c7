"""The GPUs tab's per-rank timeline (issue 40): a replayed rank's allocated (solid) and reserved
(dashed) bytes over its step, the deciding rank first, a selector for the others."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("bokeh")

from memsave_nb import Plan
from memsave_nb.parallel import measure_pipeline
from memsave_nb.parallel.verdict import worst_fit
from memsave_nb.target import Target, replay_line_bytes
from memsave_nb.ui.parallel_panel import ParallelPanel
from memsave_nb.ui.rank_timeline import rank_timeline_data

from .conftest import blocks_workload
from .test_pipeline import mlp, spec


def _shown(panel, rank) -> dict:
    """The timeline's columns, checked against the rank's own replay: the reserved column is
    ``RankMeasurement.reserved``'s timeline at the events shown, both maxima are drawn exactly."""
    data = panel.timeline.source.data
    assert data["reserved"] == [rank.reserved.reserved[i] for i in data["x"]]
    assert max(data["reserved"]) == rank.reserved.max_reserved_bytes
    assert max(data["allocated"]) == rank.reserved.max_allocated_bytes
    assert all(a <= b for a, b in zip(data["allocated"], data["reserved"]))
    return data


def test_the_gpus_tab_draws_the_deciding_ranks_allocated_and_reserved_lines():
    """FSDP2 over 2 GPUs: one rank group, its timeline under the bars, the reserved line dashed, the
    line the verdict uses (the whole GPU less context and one communicator's buffers) dotted."""
    target = Target(1)
    panel = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(), live=False, target_fn=lambda: target)
    panel.gpus.value = 2
    panel.refresh()
    result = panel.result
    rank = result.ranks[0]
    data = _shown(panel, rank)
    assert len(data["x"]) == rank.events  # a short step: every event
    fig = panel.timeline.figure
    assert fig.select_one({"name": "gpus_reserved_line"}).glyph.line_dash == [6]
    assert fig.select_one({"name": "gpus_allocated_line"}).glyph.line_dash == []
    assert fig.select_one({"name": "gpus_timeline_line"}).location == replay_line_bytes(target, 1)
    assert panel.timeline_box.children and panel.timeline_rank.layout.display == "none"  # one rank: no selector
    # the line is near (1 GiB less 1012 MiB): in range; on an 80 GB GPU it would flatten the lines: left out
    assert fig.y_range.end == pytest.approx(max(replay_line_bytes(target, 1), rank.reserved.max_reserved_bytes) * 1.12)
    far = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(), live=False, target_fn=lambda: Target(80))
    far.result = result
    far.show_target()
    assert far.timeline.figure.y_range.end == pytest.approx(rank.reserved.max_reserved_bytes * 1.12)


def test_a_pipeline_layout_shows_the_deciding_stage_and_the_selector_switches_rank():
    """PP 2 (1F1B): both stage ranks are replayed; the timeline opens on the rank ``worst_fit``
    decides on, and picking the other redraws the same figure with that rank's replay."""
    target = Target(16)
    panel = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(), live=False, target_fn=lambda: target)
    panel.result = measure_pipeline(mlp(), spec("1f1b"))
    panel.show_target()
    result = panel.result
    deciding, _ = worst_fit(target, result)
    assert [v for _, v in panel.timeline_rank.options] == [0, 1] and panel.timeline_rank.layout.display == ""
    assert result.ranks[panel.timeline_rank.value] is deciding
    _shown(panel, deciding)
    other = 1 - panel.timeline_rank.value
    fig = panel.timeline.figure
    panel.timeline_rank.value = other
    assert panel.timeline.figure is fig
    _shown(panel, result.ranks[other])
    assert f"stage {other}" in fig.title.text


def test_long_steps_are_downsampled_keeping_both_peaks():
    rank = measure_pipeline(mlp(), spec("gpipe")).ranks[1]
    data = rank_timeline_data(rank, max_points=40)
    assert len(data["x"]) <= 40 < rank.events
    assert max(data["reserved"]) == rank.reserved.max_reserved_bytes
    assert max(data["allocated"]) == rank.reserved.max_allocated_bytes


def test_ranks_without_a_replay_draw_no_timeline():
    panel = ParallelPanel(blocks_workload(), plan_fn=lambda: Plan(), live=False, target_fn=lambda: Target(16))
    panel.result = measure_pipeline(mlp(), spec("1f1b"), replay=False)
    panel.show_target()
    assert panel.timeline is None and len(panel.timeline_box.children) == 0
    assert panel.timeline_rank.layout.display == "none"
