"""The memory timeline figure: live bytes per category over the step's events, the phases as
bands, the peak marked, the allocator model's reserved line; long timelines downsampled (min/max
per bucket) keeping the peak exactly (re-exported by ``figures.py``)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
from bokeh.models import ColumnDataSource, Range1d
from bokeh.models.annotations import LabelSet
from bokeh.plotting import figure

from ..measure.result import CATEGORIES, Measurement
from .format import format_bytes
from .plot_base import (
    MAX_TIMELINE_POINTS,
    OTHER_PHASE_COLOR,
    PHASE_COLORS,
    Data,
    Plot,
    _bytes_axis,
    add_hover,
    category_color,
    legend_below,
)


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
        y_range=Range1d(start=0, end=_timeline_top(measurement) * 1.15),
        x_range=_whole_step_range(measurement),
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
    add_hover(
        fig,
        [total_line],
        [("event", "@x"), ("phase", "@phase"), ("total", "@total_label"), ("reserved", "@reserved_label")],
        mode="vline",
    )
    _bytes_axis(fig.yaxis[0])
    fig.xaxis.axis_label = "allocation / free events"
    fig.yaxis.axis_label = "live bytes"
    legend_below(fig, rows=2)

    def after(plot: Plot, new: dict[str, Data]) -> None:
        top = max(new["peak"]["y"] + new["main"]["total"] + [r for r in new["main"]["reserved"] if r == r] + [1]) * 1.15
        plot.figure.y_range.start, plot.figure.y_range.end = 0, top

    return Plot(fig, sources, data_fn, after)


def _whole_step_range(measurement: Measurement) -> Range1d:
    start, end = _phase_bounds(measurement, None)
    return Range1d(start=start, end=end)


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
