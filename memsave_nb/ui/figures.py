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

This module is the front door and holds the peak split; each other figure kind has its own file,
re-exported here: ``layer_figure.py`` (per layer), ``timeline_figure.py`` (the timeline),
``history_figures.py`` (across runs: history, budget sweep); ``plot_base.py`` holds the colours,
:class:`Plot` and the hover / tap / legend helpers every figure shares.
"""

from __future__ import annotations

from bokeh.models import ColumnDataSource, DataRange1d, FactorRange
from bokeh.models.annotations.labels import LabelSet  # where its stub declares it
from bokeh.plotting import figure

from ..measure.result import CATEGORIES, Measurement
from .format import format_bytes
from .history_figures import budget_sweep, budget_sweep_data, history, history_data, plan_label
from .layer_figure import (  # noqa: F401 - public here too
    DEFAULT_TOP,
    OTHERS_NAME,
    kept_bytes,
    kept_total,
    layer_bars,
    layer_bars_data,
    layer_label,
    own_label,
)
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
    add_hover,
    category_color,
    legend_below,
)
from .timeline_figure import (  # noqa: F401 - public here too
    downsample_indices,
    reserved_series,
    timeline,
    timeline_data,
    timeline_indices,
    timeline_peak_data,
    timeline_phases_data,
    zoom_timeline,
)


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
        add_hover(fig, [r], [("category", c.replace("_", " ")), ("bytes", f"@{c}_label"), ("peak", "@total_label")])
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
