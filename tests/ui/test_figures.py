"""Figure data equals the engine's numbers; long timelines keep their peak; stacks sum to totals."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from bokeh.models import ColumnDataSource, TapTool

from memsave_nb import measure, zoo
from memsave_nb.measure.result import CATEGORIES, Timeline
from memsave_nb.ui import figures as F
from memsave_nb.ui.format import format_bytes, format_delta_bytes, format_seconds, format_share


@pytest.fixture(scope="module")
def mlp():
    return measure(zoo.make("mlp"), mode="fake")


@pytest.fixture(scope="module")
def cnn():
    return measure(zoo.make("cnn", 4), mode="fake")


def _frozen_first(m, name="0"):
    """The same measurement with one module's saved bytes changed (a fake "plan" result)."""
    modules = tuple(
        dataclasses.replace(r, saved_bytes=r.saved_bytes + 4096, saved_bytes_own=r.saved_bytes_own + 4096)
        if r.name == name
        else r
        for r in m.modules
    )
    return dataclasses.replace(m, modules=modules)


def _long(m, n=50_000, peak_at=31_337):
    """A measurement whose timeline has ``n`` events and one sharp peak at ``peak_at``."""
    by_cat = {c: [0] * n for c in CATEGORIES}
    for i in range(n):
        by_cat["parameters"][i] = 1000
        by_cat["activations"][i] = (i * 7919) % 5000
        by_cat["temporaries"][i] = i % 3
    by_cat["temporaries"][peak_at] = 10_000
    phase = ["forward"] * 20_000 + ["backward"] * 25_000 + ["optimizer"] * (n - 45_000)
    tl = Timeline(
        phase=tuple(phase),
        by_category={c: tuple(v) for c, v in by_cat.items()},
        phase_starts={"forward": 0, "backward": 20_000, "optimizer": 45_000},
    )
    peak = sum(by_cat[c][peak_at] for c in CATEGORIES)
    return dataclasses.replace(m, timeline=tl, peak_index=peak_at, peak_bytes=peak, peak_phase="backward")


# -- format ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (47339716, "45.1 MiB"),
        (3 * 1024**3, "3.0 GiB"),
        (-2048, "-2.0 KiB"),
        (None, "-"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_helpers():
    assert format_delta_bytes(1024) == "+1.0 KiB"
    assert format_delta_bytes(-512) == "-512 B"
    assert format_share(0.39689) == "39.7%"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(None) == "-"


# -- per-layer bars --------------------------------------------------------------------------
def test_layer_bars_data_equals_measurement(mlp):
    data = F.layer_bars_data(mlp)
    # every leaf, and a parent's own bytes as their own bar (the root's loss here)
    rows = [r for r in mlp.modules if r.is_leaf or r.saved_bytes_own or r.output_bytes_own]
    total = F.kept_total(mlp)  # saved for backward + outputs and caches
    assert data["name"] == [r.name if r.is_leaf else f"{r.name} (own)" if r.name else "(own)" for r in rows]
    assert data["backward_bytes"] == [r.saved_bytes_own for r in rows]
    assert data["output_bytes"] == [r.output_bytes_own for r in rows]
    assert data["saved_bytes"] == [r.saved_bytes_own + r.output_bytes_own for r in rows]
    assert data["share"] == [(r.saved_bytes_own + r.output_bytes_own) / total for r in rows]
    assert data["delta_bytes"] == [0] * len(rows)
    assert data["saved_bytes"][data["name"].index("1")] == 256 * 1024 * 4  # ReLU keeps its float output
    assert sum(data["saved_bytes"]) == total  # every byte in exactly one bar
    assert sum(data["backward_bytes"]) == mlp.saved_bytes
    lengths = {len(v) for v in data.values()}
    assert lengths == {len(rows)}


def test_layer_bars_all_and_top(cnn):
    every = F.layer_bars_data(cnn, leaves_only=False)
    assert every["name"] == [r.name for r in cnn.modules]
    assert every["saved_bytes"][0] == F.kept_total(cnn)  # the root rolls everything up
    top = F.layer_bars_data(cnn, top=3)
    assert len(top["name"]) == 3 and top["name"][-1] == F.OTHERS_NAME
    own = [
        r.saved_bytes_own + r.output_bytes_own
        for r in cnn.modules
        if r.is_leaf or r.saved_bytes_own or r.output_bytes_own
    ]
    biggest = sorted(own, reverse=True)[:2]
    assert sorted(top["saved_bytes"][:2], reverse=True) == biggest
    assert top["label"][-1] == f"+{len(own) - 2} others"
    assert sum(top["saved_bytes"]) == F.kept_total(cnn)  # the rest summed, not dropped


def test_layer_bars_count_bytes_made_in_parent_modules():
    """nn.TransformerEncoder: attention runs inside MultiheadAttention's own forward (its only
    child, out_proj, is never called), so the leaves hold a fraction of the bytes; the bars must
    hold them all, with the attention as "layers.0.self_attn (own)"."""
    import torch
    from torch import nn

    from memsave_nb import Workload

    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
    )
    m = measure(Workload(enc, torch.randn(4, 16, 32)), repeats=0)
    leaves = sum(r.saved_bytes for r in m.modules if r.is_leaf)
    assert leaves < m.saved_bytes / 2  # the chart of leaves left most bytes out
    data = F.layer_bars_data(m)
    assert sum(data["saved_bytes"]) == F.kept_total(m) and sum(data["backward_bytes"]) == m.saved_bytes
    i = data["name"].index("layers.0.self_attn (own)")
    assert data["backward_bytes"][i] == m.module("layers.0.self_attn").saved_bytes_own > 0
    assert data["label"][i] == "layers.0.self_attn (own) (MultiheadAttention)"
    for top in (1, 3, 8):
        capped = F.layer_bars_data(m, m, top=top)
        assert len(capped["name"]) == top and sum(capped["saved_bytes"]) == F.kept_total(m)
        assert capped["delta_bytes"] == [0] * top  # the baseline's "others" is summed the same way
    plot = F.layer_bars(m, top=5)
    assert sum(plot.source.data["saved_bytes"]) == F.kept_total(m)


def test_layer_bars_split_outputs_from_saved_for_backward(mlp):
    """Outputs and caches (``output_bytes_own``, not saved for backward) are bars' own segment and
    part of the total the bars sum to."""
    outs = {r.name: (r.saved_bytes_own // 4 if r.is_leaf else 0) for r in mlp.modules}
    modules = tuple(dataclasses.replace(r, output_bytes_own=outs[r.name]) for r in mlp.modules)
    m = dataclasses.replace(mlp, modules=modules, output_bytes=sum(outs.values()))
    data = F.layer_bars_data(m)
    assert sum(data["backward_bytes"]) == m.saved_bytes
    assert sum(data["output_bytes"]) == m.output_bytes > 0
    assert sum(data["saved_bytes"]) == F.kept_total(m) == m.saved_bytes + m.output_bytes
    assert [b + o for b, o in zip(data["backward_bytes"], data["output_bytes"])] == data["saved_bytes"]
    capped = F.layer_bars_data(m, top=3)
    assert sum(capped["saved_bytes"]) == F.kept_total(m) and sum(capped["output_bytes"]) == m.output_bytes


def test_layer_bars_plot_updates_in_place(mlp):
    plot = F.layer_bars(mlp)
    fig, source = plot
    assert isinstance(source, ColumnDataSource) and fig is plot.figure
    assert source.data["saved_bytes"] == F.layer_bars_data(mlp)["saved_bytes"]
    assert list(fig.y_range.factors) == list(reversed(source.data["label"]))
    after = _frozen_first(mlp, "1")
    plot.update(after, mlp)
    assert plot.source is source  # the same source object, new data
    assert source.data["delta_bytes"] == F.layer_bars_data(after, mlp)["delta_bytes"]
    assert fig.select_one({"name": "baseline_bars"}).visible


# -- timeline --------------------------------------------------------------------------------
def test_timeline_data_is_the_timeline_when_short(mlp):
    data = F.timeline_data(mlp)
    totals = mlp.timeline.total()
    assert data["x"] == list(range(len(mlp.timeline)))
    for c in CATEGORIES:
        assert data[c] == list(mlp.timeline.by_category[c])
    assert data["total"] == list(totals)
    assert data["total"][mlp.peak_index] == mlp.peak_bytes == max(totals)


def test_timeline_stacks_sum_to_totals(cnn):
    data = F.timeline_data(cnn, max_points=300)
    for i in range(len(data["x"])):
        assert sum(data[c][i] for c in CATEGORIES) == data["total"][i]
    totals = cnn.timeline.total()
    assert data["total"] == [totals[x] for x in data["x"]]


def test_downsampling_keeps_the_peak_exactly(mlp):
    m = _long(mlp)
    data = F.timeline_data(m, max_points=2000)
    assert len(data["x"]) <= 2000
    assert data["x"] == sorted(set(data["x"]))
    assert m.peak_index in data["x"]
    i = data["x"].index(m.peak_index)
    assert data["total"][i] == m.peak_bytes == max(data["total"])
    assert {0, 20_000, 45_000, 49_999} <= set(data["x"])  # ends and phase starts
    for j in range(len(data["x"])):
        assert sum(data[c][j] for c in CATEGORIES) == data["total"][j]


def test_downsample_indices_envelope():
    values = [0] * 10_000
    values[1234] = 5
    values[8765] = -5
    idx = F.downsample_indices(values, max_points=100)
    assert len(idx) <= 100 and 1234 in idx and 8765 in idx
    assert F.downsample_indices([1, 2, 3], max_points=100) == [0, 1, 2]


def test_timeline_marks(mlp):
    plot = F.timeline(mlp)
    peak = plot.sources["peak"].data
    assert peak["x"] == [mlp.peak_index] and peak["y"] == [mlp.peak_bytes]
    assert format_bytes(mlp.peak_bytes) in peak["label"][0]
    phases = plot.sources["phases"].data
    for phase in ("forward", "backward", "optimizer"):
        assert phases["start"][phases["phase"].index(phase)] == mlp.timeline.phase_starts[phase]
    long = _long(mlp)
    plot.update(long)
    assert len(plot.source.data["x"]) <= F.MAX_TIMELINE_POINTS
    assert plot.sources["peak"].data["x"] == [long.peak_index]


# -- peak split ------------------------------------------------------------------------------
def test_peak_split_data(mlp):
    data = F.peak_split_data(mlp)
    assert data["row"] == ["peak"]
    for c in CATEGORIES:
        assert data[c] == [getattr(mlp.peak_split, c)]
    assert sum(data[c][0] for c in CATEGORIES) == mlp.peak_bytes == data["total"][0]
    with_base = F.peak_split(mlp, baseline=_frozen_first(mlp))
    assert with_base.source.data["row"] == ["baseline", "peak"]
    assert list(with_base.figure.y_range.factors) == ["peak", "baseline"]


# -- history and sweep -----------------------------------------------------------------------
def test_history_scatter(mlp):
    timed = dataclasses.replace(mlp, step_seconds=0.010)
    slower = dataclasses.replace(_frozen_first(mlp), step_seconds=0.015)
    entries = [
        SimpleNamespace(plan=None, measurement=timed),
        SimpleNamespace(plan=SimpleNamespace(name="freeze 0"), measurement=slower),
    ]
    plot = F.history(entries)
    data = plot.source.data
    assert data["peak_bytes"] == [timed.peak_bytes, slower.peak_bytes]
    assert data["x"] == [pytest.approx(10.0), pytest.approx(15.0)]
    assert data["label"] == ["baseline", "freeze 0"]
    assert plot.figure.select(type=TapTool)
    assert plot.figure.xaxis[0].axis_label == "step time (ms)"
    plot.update([SimpleNamespace(plan=None, measurement=mlp)])  # fake mode: no step time
    assert plot.source.data["x"] == [0.0] and math.isnan(plot.source.data["step_seconds"][0])
    assert "plan #" in plot.figure.xaxis[0].axis_label


def test_budget_sweep(mlp):
    points = [
        (1.0, dataclasses.replace(mlp, step_seconds=0.010)),
        (0.0, dataclasses.replace(mlp, step_seconds=0.020, saved_bytes=1)),
    ]
    data = F.budget_sweep_data(points)
    assert data["budget"] == [0.0, 1.0]
    assert data["saved_bytes"] == [1, mlp.saved_bytes]
    assert data["x"] == [pytest.approx(20.0), pytest.approx(10.0)]
    plot = F.budget_sweep([SimpleNamespace(plan=SimpleNamespace(compile_budget=0.5), measurement=mlp)])
    assert plot.source.data["budget"] == [0.5] and plot.source.data["x"] == [0.5]
    assert F.budget_sweep_data([]) == {k: [] for k in data}
    budget_point = SimpleNamespace(budget=0.25, peak_bytes=10, saved_bytes=5, step_seconds=0.002)  # session.BudgetPoint
    assert F.budget_sweep_data([budget_point])["peak_bytes"] == [10]
    assert F.budget_sweep_data([budget_point])["x"] == [pytest.approx(2.0)]


def test_timeline_range_holds_the_peak_and_labels(mlp):
    plot = F.timeline(mlp)
    assert plot.figure.y_range.end > max(plot.sources["phases"].data["label_y"]) > mlp.peak_bytes
    long = _long(mlp)
    plot.update(long)
    assert plot.figure.y_range.end > long.peak_bytes


def test_empty_timeline_draws(mlp):
    empty = dataclasses.replace(
        mlp, timeline=Timeline(phase=(), by_category={c: () for c in CATEGORIES}, phase_starts={}), peak_index=0
    )
    plot = F.timeline(empty)
    assert plot.source.data["x"] == [] and plot.sources["phases"].data["phase"] == []
    assert plot.sources["peak"].data["y"] == [empty.peak_bytes]
    plot.update(mlp)
    assert len(plot.source.data["x"]) == len(mlp.timeline)
