"""Bokeh figures built from measurement results: pure functions, no widgets, no IO.

Every builder returns a :class:`Plot`: the Bokeh ``figure``, its ``ColumnDataSource``s by name
(``plot.source`` is the main one) and ``plot.update(...)``, which takes the same arguments as the
builder and replaces each source's ``.data`` in place (what a live ``BokehModel`` needs). A
``Plot`` unpacks as ``fig, source = layer_bars(m)``.

Each figure has a matching ``*_data`` function that returns the main source's columns as plain
lists, so the explorer and the tests can compare them to the engine's numbers:

- :func:`layer_bars` / :func:`layer_bars_data`: saved activations per layer (horizontal bars,
  bytes and share, optional delta against a baseline);
- :func:`timeline` / :func:`timeline_data`: live bytes over the step's events stacked by
  category, phases as bands, the peak marked; long timelines are downsampled (min/max per
  bucket) to at most ``max_points`` points, keeping the peak event exactly;
- :func:`peak_split` / :func:`peak_split_data`: the peak's split into categories (stacked bar);
- :func:`history` / :func:`history_data`: memory against step time per plan tried, with a
  ``TapTool``: observe ``plot.source.selected.indices`` to learn which entry was clicked;
- :func:`budget_sweep` / :func:`budget_sweep_data`: a compile-budget sweep, memory against step
  time with one point per budget.

``plot_base.py`` holds the colours and :class:`Plot`; ``history_figures.py`` the figures across
runs (history, budget sweep), re-exported here.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
from bokeh.models import (
    ColumnDataSource,
    DataRange1d,
    FactorRange,
    HoverTool,
    LabelSet,
    Range1d,
)
from bokeh.plotting import figure

from ..measure.result import CATEGORIES, Measurement
from .format import format_bytes, format_delta_bytes, format_share, format_shape
from .history_figures import budget_sweep, budget_sweep_data, history, history_data, plan_label
from .plot_base import (  # noqa: F401 - the colours and Plot are public here too
    BAR_COLOR,
    CATEGORY_COLORS,
    LESS_COLOR,
    MAX_TIMELINE_POINTS,
    MORE_COLOR,
    OTHER_PHASE_COLOR,
    PHASE_COLORS,
    ROOT_LABEL,
    Data,
    Plot,
    _bytes_axis,
    category_color,
    legend_below,
)


# -- per-layer saved activations ------------------------------------------------------------
def layer_label(name: str, type_name: str) -> str:
    """The axis label of a module: ``"features.0 (Conv2d)"``; the root is ``"(model) (Net)"``."""
    return f"{name or ROOT_LABEL} ({type_name})"


def own_label(name: str, type_name: str) -> str:
    """The label of a parent module's own bytes (made in its forward, not in a child's)."""
    return f"{name or ROOT_LABEL} (own) ({type_name})"


def kept_bytes(stats: Any, *, own: bool) -> tuple[int, int]:
    """``(saved for backward, outputs and caches)`` of a module row: ``saved_bytes(_own)`` and the
    engine's ``output_bytes(_own)`` (logits, a KV cache: alive to the end of forward, not saved for
    backward; 0 from an engine that does not report them)."""
    saved = int(stats.saved_bytes_own if own else stats.saved_bytes)
    outputs = int(getattr(stats, "output_bytes_own" if own else "output_bytes", 0) or 0)
    return saved, outputs


def kept_total(measurement: Any) -> int:
    """What the step keeps at the end of forward: saved for backward plus outputs and caches."""
    return int(measurement.saved_bytes) + int(getattr(measurement, "output_bytes", 0) or 0)


DEFAULT_TOP = 25


def layer_bars_data(
    measurement: Measurement,
    baseline: Measurement | None = None,
    *,
    leaves_only: bool = True,
    top: int | None = None,
) -> Data:
    """Columns for the per-layer bars: every byte the step keeps at the end of forward in exactly
    one bar (``measurement.saved_bytes`` saved for backward plus ``measurement.output_bytes``,
    outputs and caches, when the engine reports them).

    Default (``leaves_only=True``): one bar per leaf module with its bytes, and one bar
    ``"<name> (own)"`` per parent module that made bytes in its own forward (attention inside
    ``nn.MultiheadAttention``, a functional op in a block's ``forward``), in ``named_modules()``
    order; the bars sum to the total. ``leaves_only=False`` shows every module's rolled-up bytes
    instead (parents overlap their children). ``top=N`` keeps the N largest bars and sums the rest
    into a last bar ``"+K others"`` (name ``"*others*"``), so the total is kept.

    ``saved_bytes`` is the bar's bytes, ``backward_bytes`` + ``output_bytes`` (saved for backward;
    outputs and caches); ``share`` is its fraction of the total; ``delta_bytes`` is against the same
    bar in ``baseline`` (0 without one).
    """
    total = kept_total(measurement)
    rows: list[tuple[str, str, str, Any, int, int]] = []  # name, label, type, stats, bytes, outputs
    for m in measurement.modules:
        if not leaves_only:
            saved, outputs = kept_bytes(m, own=False)
            rows.append((m.name, layer_label(m.name, m.type_name), m.type_name, m, saved + outputs, outputs))
            continue
        saved, outputs = kept_bytes(m, own=True)
        if m.is_leaf:
            rows.append((m.name, layer_label(m.name, m.type_name), m.type_name, m, saved + outputs, outputs))
        elif saved or outputs:
            rows.append(
                (
                    f"{m.name} (own)" if m.name else "(own)",
                    own_label(m.name, m.type_name),
                    m.type_name,
                    m,
                    saved + outputs,
                    outputs,
                )
            )
    others: tuple[int, int, int] | None = None
    if top is not None and len(rows) > max(0, top):
        keep_n = max(0, top - 1) if top > 0 else 0
        order = sorted(range(len(rows)), key=lambda i: -rows[i][4])
        kept_idx = set(order[:keep_n])
        rest = [rows[i] for i in range(len(rows)) if i not in kept_idx]
        others = (len(rest), sum(r[4] for r in rest), sum(r[5] for r in rest))
        rows = [rows[i] for i in range(len(rows)) if i in kept_idx]
    base_rows = (
        {r["name"]: r["saved_bytes"] for r in _rows_as_dicts(layer_bars_data(baseline, leaves_only=leaves_only))}
        if baseline is not None
        else {}
    )
    data: Data = {
        k: []
        for k in (
            "name",
            "label",
            "type_name",
            "depth",
            "output_shape",
            "saved_bytes",
            "backward_bytes",
            "output_bytes",
            "saved_label",
            "share",
            "share_label",
            "baseline_bytes",
            "delta_bytes",
            "delta_label",
            "text",
            "color",
        )
    }

    def add(
        name: str, label: str, type_name: str, depth: int, shape: str, kept: int, outputs: int, before: int | None
    ) -> None:
        share = kept / total if total else 0.0
        before = kept if before is None else before
        delta = kept - before
        data["name"].append(name)
        data["label"].append(label)
        data["type_name"].append(type_name)
        data["depth"].append(depth)
        data["output_shape"].append(shape)
        data["saved_bytes"].append(kept)
        data["backward_bytes"].append(kept - outputs)
        data["output_bytes"].append(outputs)
        data["saved_label"].append(format_bytes(kept))
        data["share"].append(share)
        data["share_label"].append(format_share(share))
        data["baseline_bytes"].append(before)
        data["delta_bytes"].append(delta)
        data["delta_label"].append(format_delta_bytes(delta) if baseline is not None else "")
        text = f"{format_bytes(kept)} ({format_share(share)})"
        if outputs:
            text += f", outputs {format_bytes(outputs)}"
        if baseline is not None and delta:
            text += f"  {format_delta_bytes(delta)}"
        data["text"].append(text)
        data["color"].append(BAR_COLOR if delta == 0 else (MORE_COLOR if delta > 0 else LESS_COLOR))

    for name, label, type_name, m, kept, outputs in rows:
        add(
            name,
            label,
            type_name,
            m.depth,
            format_shape(m.output_shape),
            kept,
            outputs,
            base_rows.get(name) if baseline is not None else None,
        )
    if others is not None:
        count, kept, outputs = others
        before = None
        if baseline is not None:
            shown = set(data["name"])
            before = sum(v for n, v in base_rows.items() if n not in shown)
        add(OTHERS_NAME, f"+{count} others", "", 0, "-", kept, outputs, before)
    return data


OTHERS_NAME = "*others*"


def _rows_as_dicts(data: Data) -> list[dict[str, Any]]:
    keys = list(data)
    return [dict(zip(keys, vals)) for vals in zip(*(data[k] for k in keys))]


def layer_bars(
    measurement: Measurement,
    baseline: Measurement | None = None,
    *,
    leaves_only: bool = True,
    top: int | None = DEFAULT_TOP,
    width: int = 760,
    title: str = "Saved activations per layer",
) -> Plot:
    """Horizontal bars of the bytes each layer keeps for backward (first layer on top), outputs and
    caches in a lighter shade; a parent's own bytes are their own bar and the bars beyond ``top`` are
    summed into one, so the bars add up to the total. With a baseline, its bars are drawn as dashed
    outlines and the bars are coloured by the change (red more, green less)."""

    def data_fn(m: Measurement, b: Measurement | None = None, **kw: Any) -> dict[str, Data]:
        return {"main": layer_bars_data(m, b, leaves_only=kw.get("leaves_only", leaves_only), top=kw.get("top", top))}

    datas = data_fn(measurement, baseline)
    source = ColumnDataSource(datas["main"], name="layer_bars")
    factors = list(reversed(datas["main"]["label"]))
    fig = figure(
        y_range=FactorRange(factors=factors),
        x_range=DataRange1d(start=0, range_padding=0.35),
        width=width,
        height=_bars_height(len(factors)),
        title=title,
        toolbar_location="above",
        tools="save,reset",
        name="layer_bars_figure",
    )
    fig.hbar(
        y="label",
        right="baseline_bytes",
        height=0.8,
        source=source,
        fill_alpha=0.0,
        line_color="#555555",
        line_dash="dashed",
        visible=baseline is not None,
        name="baseline_bars",
    )
    bars = fig.hbar(y="label", right="backward_bytes", height=0.6, source=source, color="color", name="saved_bars")
    fig.hbar(
        y="label",
        left="backward_bytes",
        right="saved_bytes",
        height=0.6,
        source=source,
        color=CATEGORY_COLORS["outputs"],
        name="output_bars",
    )
    fig.add_layout(
        LabelSet(
            x="saved_bytes",
            y="label",
            text="text",
            source=source,
            x_offset=4,
            y_offset=-6,
            text_font_size="9pt",
            text_color="#333333",
        )
    )
    fig.add_tools(
        HoverTool(
            renderers=[bars],
            tooltips=[
                ("module", "@name"),
                ("type", "@type_name"),
                ("output", "@output_shape"),
                ("kept", "@saved_label"),
                ("share", "@share_label"),
                ("vs baseline", "@delta_label"),
            ],
        )
    )
    _bytes_axis(fig.xaxis[0])
    fig.xaxis.axis_label = "kept for backward (outputs and caches lighter)"
    fig.ygrid.grid_line_color = None

    def after(plot: Plot, new: dict[str, Data]) -> None:
        labels = list(reversed(new["main"]["label"]))
        plot.figure.y_range.factors = labels
        plot.figure.height = _bars_height(len(labels))
        has_baseline = any(new["main"]["delta_label"])
        plot.figure.select_one({"name": "baseline_bars"}).visible = has_baseline

    return Plot(fig, {"main": source}, data_fn, after)


def _bars_height(rows: int) -> int:
    return max(180, 70 + 22 * rows)


# -- the memory timeline ---------------------------------------------------------------------
def downsample_indices(
    values: Sequence[float], max_points: int = MAX_TIMELINE_POINTS, keep: Iterable[int] = ()
) -> list[int]:
    """Indices of at most ``max_points`` points that keep the shape of ``values``: the first and
    last point, every index in ``keep``, the global maximum, and the minimum and maximum of each of
    equal-width buckets. Returns ``range(len(values))`` when it already fits."""
    n = len(values)
    if n <= max_points:
        return list(range(n))
    arr = np.asarray(values, dtype=np.float64)
    must = {0, n - 1, int(arr.argmax())} | {int(i) for i in keep if 0 <= int(i) < n}
    buckets = max(1, (max_points - len(must)) // 2)
    chosen = set(must)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            part = arr[a:b]
            chosen.add(int(a + part.argmin()))
            chosen.add(int(a + part.argmax()))
    return sorted(chosen)


def timeline_indices(measurement: Measurement, max_points: int = MAX_TIMELINE_POINTS) -> list[int]:
    """The event indices the timeline figure shows (the peak and each phase start always)."""
    t = measurement.timeline
    keep = [measurement.peak_index, *t.phase_starts.values()]
    reserved = reserved_series(measurement)
    if reserved:  # the reserved line's own maximum is drawn exactly too
        keep.append(max(range(len(reserved)), key=reserved.__getitem__))
    return downsample_indices(t.total(), max_points, keep)


def reserved_series(measurement: Measurement) -> tuple[int, ...]:
    """The allocator model's reserved bytes after each timeline event (``Measurement.reserved``),
    or () where the step has no replay (or one that does not match its timeline)."""
    r = getattr(measurement, "reserved", None)
    series = tuple(r.reserved) if r is not None else ()
    return series if len(series) == len(measurement.timeline) else ()


def timeline_data(measurement: Measurement, max_points: int = MAX_TIMELINE_POINTS) -> Data:
    """Columns of the timeline: ``x`` (event index in the full timeline), ``phase``, one column of
    live bytes per category (stacked in :data:`CATEGORIES` order) and their ``total``."""
    t = measurement.timeline
    idx = timeline_indices(measurement, max_points)
    totals = t.total()
    data: Data = {"x": idx, "phase": [t.phase[i] for i in idx]}
    for c in CATEGORIES:
        col = t.by_category.get(c, ())
        data[c] = [col[i] if col else 0 for i in idx]
    data["total"] = [totals[i] for i in idx]
    data["total_label"] = [format_bytes(v) for v in data["total"]]
    reserved = reserved_series(measurement)  # NaN draws nothing: no replay, no second line
    data["reserved"] = [reserved[i] if reserved else float("nan") for i in idx]
    data["reserved_label"] = [format_bytes(reserved[i]) if reserved else "no replay" for i in idx]
    return data


def timeline_phases_data(measurement: Measurement) -> Data:
    """One row per phase: ``start``/``end`` event indices, the label's height and the band's colour."""
    t = measurement.timeline
    starts = sorted(t.phase_starts.items(), key=lambda kv: kv[1])
    end_of_step = max(len(t) - 1, 0)
    label_y = _timeline_top(measurement) * 1.06
    data: Data = {"phase": [], "start": [], "end": [], "label_y": [], "color": []}
    for i, (phase, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else end_of_step
        if end <= start and phase not in PHASE_COLORS:
            continue  # an empty bookkeeping phase ("done" at the very end)
        data["phase"].append(phase)
        data["start"].append(start)
        data["end"].append(end)
        data["label_y"].append(label_y)
        data["color"].append(PHASE_COLORS.get(phase, OTHER_PHASE_COLOR))
    return data


def _timeline_top(measurement: Measurement) -> float:
    totals = measurement.timeline.total()
    return float(
        max(max(totals) if totals else 0, max(reserved_series(measurement), default=0), measurement.peak_bytes, 1)
    )


def timeline_peak_data(measurement: Measurement) -> Data:
    return {
        "x": [measurement.peak_index],
        "y": [measurement.peak_bytes],
        "phase": [measurement.peak_phase],
        "label": [f"peak {format_bytes(measurement.peak_bytes)} ({measurement.peak_phase})"],
    }


def timeline(
    measurement: Measurement,
    max_points: int = MAX_TIMELINE_POINTS,
    *,
    width: int = 760,
    height: int = 320,
    title: str = "Live memory over the step",
) -> Plot:
    """Live bytes per category over the step's allocation events (stacked areas), the forward,
    backward and optimizer phases as shaded bands, the peak marked with its value, and the
    allocator model's predicted reserved bytes as a second line (``reserved_line``) where the step
    was replayed."""

    def data_fn(m: Measurement, points: int = max_points) -> dict[str, Data]:
        return {"main": timeline_data(m, points), "phases": timeline_phases_data(m), "peak": timeline_peak_data(m)}

    datas = data_fn(measurement)
    sources = {k: ColumnDataSource(v, name=f"timeline_{k}") for k, v in datas.items()}
    fig = figure(
        width=width,
        height=height,
        title=title,
        y_range=Range1d(0, _timeline_top(measurement) * 1.15),
        x_range=Range1d(*_phase_bounds(measurement, None)),
        tools="xpan,xwheel_zoom,box_zoom,save,reset",
        toolbar_location="above",
        name="timeline_figure",
    )
    fig.vstrip(x0="start", x1="end", source=sources["phases"], color="color", alpha=0.6, name="phase_bands")
    fig.vspan(x="start", source=sources["phases"], line_color="#999999", line_dash="dotted", name="phase_lines")
    fig.add_layout(
        LabelSet(
            x="start",
            y="label_y",
            text="phase",
            source=sources["phases"],
            x_offset=3,
            text_font_size="9pt",
            text_color="#555555",
        )
    )
    fig.varea_stack(
        stackers=list(CATEGORIES),
        x="x",
        source=sources["main"],
        color=[category_color(c) for c in CATEGORIES],
        legend_label=[c.replace("_", " ") for c in CATEGORIES],
        fill_alpha=0.85,
    )
    total_line = fig.line(x="x", y="total", source=sources["main"], color="#333333", line_width=1, name="total_line")
    fig.step(
        x="x",
        y="reserved",
        source=sources["main"],
        mode="after",
        color="#9467bd",
        line_width=1.5,
        line_dash="dashed",
        legend_label="reserved (allocator model)",
        name="reserved_line",
    )
    fig.scatter(
        x="x", y="y", source=sources["peak"], marker="inverted_triangle", size=12, color="#d62728", name="peak_marker"
    )
    fig.add_layout(
        LabelSet(
            x="x",
            y="y",
            text="label",
            source=sources["peak"],
            x_offset=8,
            y_offset=2,
            text_font_size="9pt",
            text_font_style="bold",
            text_color="#d62728",
        )
    )
    fig.add_tools(
        HoverTool(
            renderers=[total_line],
            mode="vline",
            tooltips=[
                ("event", "@x"),
                ("phase", "@phase"),
                ("total", "@total_label"),
                ("reserved", "@reserved_label"),
            ],
        )
    )
    _bytes_axis(fig.yaxis[0])
    fig.xaxis.axis_label = "allocation / free events"
    fig.yaxis.axis_label = "live bytes"
    legend_below(fig, rows=2)

    def after(plot: Plot, new: dict[str, Data]) -> None:
        top = max(new["peak"]["y"] + new["main"]["total"] + [r for r in new["main"]["reserved"] if r == r] + [1]) * 1.15
        plot.figure.y_range.start, plot.figure.y_range.end = 0, top

    return Plot(fig, sources, data_fn, after)


def _phase_bounds(measurement: Measurement, phase: str | None) -> tuple[float, float]:
    """Event-index bounds of ``phase`` (None: the whole step), padded half an event each side."""
    t = measurement.timeline
    last = max(len(t) - 1, 1)
    if phase is None or phase not in t.phase_starts:
        return -0.5, last + 0.5
    starts = sorted(t.phase_starts.values())
    start = t.phase_starts[phase]
    later = [v for v in starts if v > start]
    end = later[0] if later else last
    return start - 0.5, max(end, start + 1) + 0.5


def zoom_timeline(plot: Plot, measurement: Measurement, phase: str | None) -> tuple[float, float]:
    """Set the timeline's x range to one phase (``"forward"``, ``"backward"``, ``"optimizer"``) or
    the whole step (None), so a short backward or optimizer phase of a big model fills the width."""
    start, end = _phase_bounds(measurement, phase)
    rng = plot.figure.x_range
    rng.start, rng.end = start, end
    return start, end


# -- peak split ------------------------------------------------------------------------------
def peak_split_data(measurement: Measurement, baseline: Measurement | None = None) -> Data:
    """One row per bar (``"baseline"`` first when given, then ``"peak"``): bytes per category at the
    peak, with ``<category>_label`` texts and the ``total``."""
    rows = ([("baseline", baseline)] if baseline is not None else []) + [("peak", measurement)]
    data: Data = {"row": [r for r, _ in rows]}
    for c in CATEGORIES:
        data[c] = [getattr(m.peak_split, c) for _, m in rows]
        data[f"{c}_label"] = [format_bytes(v) for v in data[c]]
    data["total"] = [m.peak_bytes for _, m in rows]
    data["total_label"] = [f"{format_bytes(m.peak_bytes)} ({m.peak_phase})" for _, m in rows]
    return data


def peak_split(
    measurement: Measurement,
    baseline: Measurement | None = None,
    *,
    width: int = 760,
    title: str = "Peak memory by category",
) -> Plot:
    """A stacked horizontal bar of the peak's categories (and the baseline's peak beneath it)."""

    def data_fn(m: Measurement, b: Measurement | None = None) -> dict[str, Data]:
        return {"main": peak_split_data(m, b)}

    datas = data_fn(measurement, baseline)
    source = ColumnDataSource(datas["main"], name="peak_split")
    rows = list(reversed(datas["main"]["row"]))
    fig = figure(
        y_range=FactorRange(factors=rows),
        x_range=DataRange1d(start=0, range_padding=0.8),
        width=width,
        height=_split_height(len(rows)),
        title=title,
        tools="save,reset",
        toolbar_location="above",
        name="peak_split_figure",
    )
    renderers = fig.hbar_stack(
        list(CATEGORIES),
        y="row",
        height=0.6,
        source=source,
        color=[category_color(c) for c in CATEGORIES],
        legend_label=[c.replace("_", " ") for c in CATEGORIES],
    )
    for c, r in zip(CATEGORIES, renderers):
        fig.add_tools(
            HoverTool(
                renderers=[r],
                tooltips=[("category", c.replace("_", " ")), ("bytes", f"@{c}_label"), ("peak", "@total_label")],
            )
        )
    fig.add_layout(
        LabelSet(x="total", y="row", text="total_label", source=source, x_offset=4, y_offset=-6, text_font_size="9pt")
    )
    _bytes_axis(fig.xaxis[0])
    legend_below(fig, rows=2)
    fig.ygrid.grid_line_color = None

    def after(plot: Plot, new: dict[str, Data]) -> None:
        factors = list(reversed(new["main"]["row"]))
        plot.figure.y_range.factors = factors
        plot.figure.height = _split_height(len(factors))

    return Plot(fig, {"main": source}, data_fn, after)


def _split_height(rows: int) -> int:
    return 150 + 45 * rows


__all__ = [
    "Plot",
    "CATEGORY_COLORS",
    "PHASE_COLORS",
    "MAX_TIMELINE_POINTS",
    "layer_bars",
    "layer_bars_data",
    "layer_label",
    "timeline",
    "timeline_data",
    "timeline_phases_data",
    "timeline_peak_data",
    "timeline_indices",
    "downsample_indices",
    "peak_split",
    "peak_split_data",
    "history",
    "history_data",
    "plan_label",
    "zoom_timeline",
    "kept_bytes",
    "kept_total",
    "category_color",
    "own_label",
    "OTHERS_NAME",
    "budget_sweep",
    "budget_sweep_data",
]
