"""The planner's front as a user reads it (issue 28, items 2, 3, 5), without a browser: one click on
a Pareto point runs the plan once, the front list keeps its rows' height and folds the same plan
at other offload counts, the scatter's headroom line is a visible glyph inside the y range, and
stacked candidates say how many they are."""

from __future__ import annotations

import pytest

from memsave_nb import zoo
from memsave_nb.plan import Plan
from memsave_nb.planner import Candidate
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.front_list import FrontList
from memsave_nb.ui.pareto_figure import pareto

pytestmark = pytest.mark.timeout(300)
TINY_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
MIB = 2**20


def _candidate(n_offload: int, peak_mib: float, ms: float, *, full: int = 0, fits: bool = True) -> Candidate:
    regions = {f"blocks.{i}": "full" for i in range(full)}
    regions.update({f"blocks.{full + i}": "offload" for i in range(n_offload)})
    return Candidate(Plan(regions=regions), "as given, as given", int(peak_mib * MIB), ms / 1e3, fits)


@pytest.mark.slow
def test_one_click_on_a_pareto_point_runs_the_step_once():
    explorer = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=4), mode="fake", repeats=0), live=True, debounce_s=0.0)
    panel = explorer.tuner
    runs: list = []
    explorer.on_result(runs.append)
    result = panel.search(precisions=(None,))
    assert result is not None and explorer.wait(60)
    runs.clear()
    index = next(i for i, c in enumerate(panel.candidates) if c.plan.active_regions)
    panel.plot.source.selected.indices = [index]  # the tap
    assert explorer.wait(120)
    # what the browser sends back after the run's redraw: the selection cleared, then the same point
    panel.plot.source.selected.indices = []
    panel.plot.source.selected.indices = [index]
    assert explorer.wait(120)
    assert len(runs) == 1, [e.plan.describe() for e in runs]
    assert runs[0].plan.replace(name="") == panel.candidates[index].plan.replace(name="")
    # a different point is a new click: it runs, once
    other = next(i for i, c in enumerate(panel.candidates) if i != index)
    panel.plot.source.selected.indices = [other]
    assert explorer.wait(120)
    assert len(runs) == 2


def test_front_list_keeps_row_height_scrolls_and_folds_offload_counts():
    # 50 front entries: 10 distinct plans (0..9 blocks fully checkpointed), each at 5 offload counts
    front = [_candidate(n, 1000 - 10 * full - n, 1 + full + n / 10, full=full) for full in range(10) for n in range(5)]
    loaded: list[int] = []
    box = FrontList(loaded.append)
    box.set_front(front, list(range(100, 150)))
    box.show(front, picked_row=None)
    assert len(box.rows) == 50
    assert box.layout.overflow == "auto" and box.layout.max_height == "380px"
    for row in box.rows:  # a row never shrinks below its own height
        assert row.layout.flex == "0 0 auto" and row.layout.min_height == "34px"
    shown = [k for k, r in enumerate(box.rows) if r.layout.display != "none"]
    assert shown == [5 * full for full in range(10)]  # one row per distinct plan
    assert "+4 like it with other offload counts" in box.rows[0].children[1].value
    assert "50 plans, 10 distinct" in box.heading.value
    box.show_all.value = True
    assert all(r.layout.display != "none" for r in box.rows)
    assert "like it" not in box.rows[0].children[1].value
    box.rows[7].children[0].click()
    assert loaded == [107]
    # a short front is read whole (a trade-off curve), near-duplicates too: no toggle
    short = [_candidate(n, 100 - n, 1 + n) for n in range(3)]
    box.set_front(short, [0, 1, 2])
    assert box.show_all.layout.display == "none" and all(r.layout.display != "none" for r in box.rows)


def test_scatter_headroom_line_is_a_visible_glyph_and_stacks_say_how_many():
    usable = 500 * MIB
    cands = [_candidate(0, 900, 2.0), _candidate(1, 900, 2.0), _candidate(2, 900, 2.0), _candidate(0, 700, 3.0, full=1)]
    plot = pareto(cands, cands[:1], usable)
    line = plot.figure.select_one({"name": "headroom_line"})
    assert line is not None and line.visible
    # a glyph renderer: the data range widens to include it though every point lies above it
    assert line in plot.figure.renderers and plot.figure.y_range.renderers in ([], "auto")
    assert plot.sources["headroom"].data["peak_bytes"] == [usable, usable]
    assert plot.sources["headroom"].data["ms"] == [2.0, 3.0]
    data = plot.source.data
    assert data["stacked"] == [3, 3, 3, 1]
    assert data["stack_text"] == ["×3", "", "", ""]
    # a new line moves with an update
    plot.update(cands, cands[:1], 2 * usable)
    assert plot.sources["headroom"].data["peak_bytes"] == [2 * usable, 2 * usable]


@pytest.mark.slow
def test_none_fits_says_which_knob_would_with_the_figure_it_reaches():
    from memsave_nb.measure import measure
    from memsave_nb.planner import hint_lines, plan_for
    from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, fit_of, measure_peak

    explorer = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=128), mode="fake", repeats=0), live=False, debounce_s=0.0)
    panel = explorer.tuner
    workload = explorer.session.workload
    search = {"precisions": (None,), "region_kinds": ("full",), "micro_batches": (1,)}
    lowest = min(c.est_peak_bytes for c in plan_for(workload, Target(24), **search).candidates)
    # batch 128: its steps outgrow the allocator's 2 MiB small-pool segments, so the replay resolves them
    batch1_reserved = measure_peak(workload, Plan(batch_size=1)).reserved.max_reserved_bytes
    assert batch1_reserved < lowest
    # past the CUDA context the verdict adds: batch 1 fits; no plan of the search does
    panel.set_target((CUDA_CONTEXT_BYTES + (batch1_reserved + lowest) / 2) / 2**30)
    panel.search(**search)
    assert panel.result is not None and not panel.result.fitting and panel.result.chosen is None
    assert "none fits;" in panel.status.value and "would on" in panel.status.value
    hints = {h.knob: h for h in panel.hints}
    batch = hints["smaller batch"]
    assert batch.fits and batch.plan is not None
    b = batch.plan.batch_size
    assert 1 <= b < 128 and f"batch {b} (from 128)" == batch.change
    # the oracle: that batch measured here, and the next one up does not fit
    with batch.plan.apply(workload) as wl:
        assert measure(wl, mode="fake", repeats=0).peak_bytes == batch.peak_bytes
    assert fit_of(panel.target, measure_peak(workload, batch.plan)).fits
    assert not fit_of(panel.target, measure_peak(workload, Plan(batch_size=b + 1))).fits
    # every knob's figure is the peak of its own plan
    for h in panel.hints:
        if h.plan is not None:
            assert measure_peak(workload, h.plan).peak_bytes == h.peak_bytes, h.knob
    assert {"smaller batch", "micro-batches", "precision", "freezing", "checkpointing", "offload", "more GPUs"} <= set(
        hints
    )
    box = panel.hints_box.value
    assert "memsave-hint memsave-fits" in box and f"batch {b} (from 128)" in box
    lines = hint_lines(panel.hints, panel.target)
    assert lines[0] == "knobs that fit on their own:" and any(f"batch {b}" in line for line in lines)
