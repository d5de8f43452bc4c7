"""Figures across runs: memory against step time per plan tried (:func:`history`, with a
``TapTool``) and a compile-budget sweep (:func:`budget_sweep`). Re-exported by ``figures.py``."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from bokeh.models import ColumnDataSource
from bokeh.models.annotations.labels import LabelSet  # where its stub declares it

from ..measure.result import Measurement
from .format import format_bytes, format_seconds
from .plot_base import (
    BAR_COLOR,
    CATEGORY_COLORS,
    Data,
    Plot,
    _bytes_axis,
    _measurement,
    add_hover,
    add_pick_tools,
    legend_below,
    pan_zoom_figure,
)


# -- history of plans tried ------------------------------------------------------------------
def plan_label(plan: Any) -> str:
    """A short name for a plan: its ``name``, else ``describe()``, else ``str``; ``None`` is the baseline."""
    if plan is None:
        return "baseline"
    name = getattr(plan, "name", "")
    if name:
        return str(name)
    describe = getattr(plan, "describe", None)
    if callable(describe):
        return str(describe())
    return str(plan)


def _seconds(m: Measurement) -> float:
    return m.step_seconds if m.step_seconds is not None else math.nan


def history_data(entries: Sequence[Any], current: int | None = None) -> Data:
    """One row per entry (objects with ``.plan`` and ``.measurement``, e.g. a session's history):
    ``x`` is the step time in milliseconds, or the entry's index when a run has no time (fake mode)."""
    ms = [_measurement(e) for e in entries]
    timed = bool(ms) and all(m.step_seconds is not None for m in ms)
    data: Data = {
        k: []
        for k in (
            "index",
            "x",
            "peak_bytes",
            "saved_bytes",
            "step_seconds",
            "label",
            "peak_label",
            "saved_label",
            "time_label",
            "color",
            "size",
        )
    }
    for i, (e, m) in enumerate(zip(entries, ms)):
        data["index"].append(i)
        data["x"].append(_seconds(m) * 1e3 if timed else float(i))
        data["peak_bytes"].append(m.peak_bytes)
        data["saved_bytes"].append(m.saved_bytes)
        data["step_seconds"].append(_seconds(m))
        data["label"].append(plan_label(getattr(e, "plan", None)))
        data["peak_label"].append(format_bytes(m.peak_bytes))
        data["saved_label"].append(format_bytes(m.saved_bytes))
        data["time_label"].append(format_seconds(m.step_seconds))
        data["color"].append("#d62728" if i == current else ("#555555" if i == 0 else BAR_COLOR))
        data["size"].append(14 if i == current else 10)
    # text on the plot for the baseline and the current plan only (the others in the hover): labels
    # of close points would overlap
    data["point_label"] = [lab if (i == 0 or i == current) else "" for i, lab in enumerate(data["label"])]
    return data


def history(
    entries: Sequence[Any],
    current: int | None = None,
    *,
    width: int = 520,
    height: int = 360,
    title: str = "Plans tried: peak memory vs step time",
) -> Plot:
    """Peak memory against step time, one point per plan tried; click a point to select it
    (``plot.source.selected.indices``; the explorer restores that plan)."""

    def data_fn(es: Sequence[Any], cur: int | None = None) -> dict[str, Data]:
        return {"main": history_data(es, cur)}

    datas = data_fn(entries, current)
    source = ColumnDataSource(datas["main"], name="history")
    fig = pan_zoom_figure("history_figure", title, width, height, 0.15)
    points = fig.scatter(
        x="x",
        y="peak_bytes",
        source=source,
        size="size",
        color="color",
        alpha=0.85,
        selection_color="#d62728",
        nonselection_alpha=0.35,
        name="history_points",
    )
    fig.add_layout(
        LabelSet(
            x="x",
            y="peak_bytes",
            text="point_label",
            source=source,
            x_offset=7,
            y_offset=4,
            text_font_size="8pt",
            text_color="#333333",
        )
    )
    add_pick_tools(
        fig, points, [("plan", "@label"), ("peak", "@peak_label"), ("saved", "@saved_label"), ("step", "@time_label")]
    )
    _bytes_axis(fig.yaxis[0])
    fig.yaxis.axis_label = "peak memory"
    _history_axis(fig, datas["main"])

    def after(plot: Plot, new: dict[str, Data]) -> None:
        _history_axis(plot.figure, new["main"])

    return Plot(fig, {"main": source}, data_fn, after)


def _history_axis(fig: Any, data: Data) -> None:
    timed = bool(data["x"]) and not any(math.isnan(s) for s in data["step_seconds"])
    fig.xaxis.axis_label = "step time (ms)" if timed else "plan # (no step time in fake mode)"
    _spread_range(fig.y_range, data["peak_bytes"])
    _spread_range(fig.x_range, data["x"], from_zero=False)


def _spread_range(rng: Any, values: Sequence[float], *, from_zero: bool = True) -> None:
    """Set a range from its values with 15% room; when they are (nearly) all equal, e.g. a one-point
    plot, from 0 (or a quarter either side): an automatic range around a single value has ticks
    that all read the same number."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    if hi - lo > 0.02 * max(abs(hi), 1e-12):
        pad = 0.15 * (hi - lo)
        rng.start, rng.end = (max(0.0, lo - pad) if from_zero else lo - pad), hi + pad
        return
    if from_zero:
        rng.start, rng.end = 0, (hi * 1.25 if hi > 0 else 1)
    else:
        pad = max(abs(hi) * 0.25, 1.0)
        rng.start, rng.end = lo - pad, hi + pad


# -- compile-budget sweep --------------------------------------------------------------------
def _sweep_point(point: Any) -> tuple[float, Any]:
    """``(budget, record)`` where the record has ``peak_bytes``, ``saved_bytes``, ``step_seconds``
    (a Measurement, or a session's ``BudgetPoint``)."""
    if isinstance(point, tuple) and len(point) == 2:
        return float(point[0]), _measurement(point[1])
    budget = getattr(point, "budget", None)
    if budget is None:
        budget = getattr(getattr(point, "plan", None), "compile_budget", None)
    if budget is None:
        raise ValueError(f"cannot tell the compile budget of sweep point {point!r}")
    return float(budget), _measurement(point)


def budget_sweep_data(points: Iterable[Any]) -> Data:
    """One row per budget, sorted by budget. ``points`` are ``(budget, measurement)`` pairs, objects
    with ``.budget``, ``.peak_bytes``, ``.saved_bytes``, ``.step_seconds`` (a session's
    ``BudgetPoint``), or entries with ``.plan.compile_budget`` and ``.measurement``. ``x`` is the step
    time in ms, or the budget itself when a run has no time."""
    rows = sorted((_sweep_point(p) for p in points), key=lambda bm: bm[0])
    timed = bool(rows) and all(m.step_seconds is not None for _, m in rows)
    data: Data = {
        k: []
        for k in (
            "budget",
            "x",
            "peak_bytes",
            "saved_bytes",
            "step_seconds",
            "budget_label",
            "peak_label",
            "saved_label",
            "time_label",
        )
    }
    for budget, m in rows:
        data["budget"].append(budget)
        data["x"].append(m.step_seconds * 1e3 if timed else budget)
        data["peak_bytes"].append(m.peak_bytes)
        data["saved_bytes"].append(m.saved_bytes)
        data["step_seconds"].append(_seconds(m))
        data["budget_label"].append(f"{budget:g}")
        data["peak_label"].append(format_bytes(m.peak_bytes))
        data["saved_label"].append(format_bytes(m.saved_bytes))
        data["time_label"].append(format_seconds(m.step_seconds))
    return data


def budget_sweep(
    points: Iterable[Any],
    *,
    width: int = 520,
    height: int = 360,
    title: str = "Compile memory budget: memory vs step time",
) -> Plot:
    """Peak and saved bytes against step time, one point per ``activation_memory_budget``, each
    labelled with its budget, connected in budget order."""

    def data_fn(ps: Iterable[Any]) -> dict[str, Data]:
        return {"main": budget_sweep_data(ps)}

    datas = data_fn(points)
    source = ColumnDataSource(datas["main"], name="budget_sweep")
    fig = pan_zoom_figure("budget_sweep_figure", title, width, height, 0.15, y_start=0)
    fig.line(x="x", y="peak_bytes", source=source, color=CATEGORY_COLORS["optimizer_state"], legend_label="peak")
    peak_pts = fig.scatter(
        x="x",
        y="peak_bytes",
        source=source,
        size=9,
        color=CATEGORY_COLORS["optimizer_state"],
        legend_label="peak",
        name="sweep_peak",
    )
    fig.line(
        x="x", y="saved_bytes", source=source, color=CATEGORY_COLORS["activations"], legend_label="saved activations"
    )
    saved_pts = fig.scatter(
        x="x",
        y="saved_bytes",
        source=source,
        size=9,
        marker="square",
        color=CATEGORY_COLORS["activations"],
        legend_label="saved activations",
        name="sweep_saved",
    )
    fig.add_layout(
        LabelSet(
            x="x", y="peak_bytes", text="budget_label", source=source, x_offset=6, y_offset=4, text_font_size="8pt"
        )
    )
    add_hover(
        fig,
        [peak_pts, saved_pts],
        [("budget", "@budget_label"), ("peak", "@peak_label"), ("saved", "@saved_label"), ("step", "@time_label")],
    )
    _bytes_axis(fig.yaxis[0])
    fig.yaxis.axis_label = "bytes"
    legend_below(fig)
    _sweep_axis(fig, datas["main"])

    def after(plot: Plot, new: dict[str, Data]) -> None:
        _sweep_axis(plot.figure, new["main"])

    return Plot(fig, {"main": source}, data_fn, after)


def _sweep_axis(fig: Any, data: Data) -> None:
    timed = bool(data["x"]) and not any(math.isnan(s) for s in data["step_seconds"])
    fig.xaxis.axis_label = "step time (ms)" if timed else "activation memory budget"
