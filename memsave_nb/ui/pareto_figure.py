"""The planner's scatter (pure: candidates in, Bokeh out): estimated peak against estimated step
time, one point per candidate plan, front points larger, green fits and red does not.

The line the estimates face (renderer ``headroom_line``: the GPU less the CUDA context, as
``target.estimate_fits`` judges a plan before its step is replayed) is a line *glyph*, not a ``Span``: a data range
only widens for glyphs, so when every point lies above the line a Span sat off-screen. Candidates
that land on the same (time, peak) stack under one point: the point says how many (``×N`` beside
it, and ``plans here`` in its hover).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

from bokeh.models import ColumnDataSource

from .format import format_bytes
from .plot_base import Data, Plot, _bytes_axis, add_pick_tools, legend_corner, pan_zoom_figure

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.planner import Candidate

FITS_COLOR = "#2ca02c"
MISS_COLOR = "#d62728"
LINE_COLOR = "#777777"


def _spot(c: "Candidate") -> tuple[float, int]:
    """Where a candidate's point is drawn (the key under which candidates stack)."""
    return round(c.est_seconds * 1e3, 6), int(c.est_peak_bytes)


def pareto_data(candidates: Sequence["Candidate"], front: Sequence["Candidate"] = ()) -> Data:
    on_front = {id(c) for c in front}
    stacked = Counter(_spot(c) for c in candidates)
    first_at: dict[tuple[float, int], int] = {}
    keys = (
        "index",
        "ms",
        "peak_bytes",
        "label",
        "peak_label",
        "fits",
        "color",
        "size",
        "config",
        "stacked",
        "stack_text",
    )
    data: Data = {k: [] for k in keys}
    for i, c in enumerate(candidates):
        spot = _spot(c)
        n = stacked[spot]
        data["index"].append(i)
        data["ms"].append(c.est_seconds * 1e3)
        data["peak_bytes"].append(c.est_peak_bytes)
        data["label"].append(c.label)
        data["peak_label"].append(format_bytes(c.est_peak_bytes))
        data["fits"].append("fits" if c.fits else "does not fit")
        data["color"].append(FITS_COLOR if c.fits else MISS_COLOR)
        data["size"].append(11 if id(c) in on_front else 6)
        data["config"].append(c.config)
        data["stacked"].append(n)
        # the count is written once per spot, beside its first candidate
        data["stack_text"].append(f"×{n}" if n > 1 and first_at.setdefault(spot, i) == i else "")
    return data


def headroom_data(candidates: Sequence["Candidate"], usable_bytes: int | None) -> Data:
    """The headroom line's two ends: across the points' time range (or a unit one when empty)."""
    if usable_bytes is None:
        return {"ms": [], "peak_bytes": []}
    ms = [c.est_seconds * 1e3 for c in candidates] or [0.0, 1.0]
    return {"ms": [min(ms), max(ms)], "peak_bytes": [usable_bytes, usable_bytes]}


def pareto(
    candidates: Sequence["Candidate"],
    front: Sequence["Candidate"] = (),
    usable_bytes: int | None = None,
    *,
    width: int = 620,
    height: int = 380,
) -> Plot:
    """The scatter with its headroom line; ``plot.update(candidates, front, usable_bytes)`` refreshes it."""

    def data_fn(cs: Sequence[Any], fr: Sequence[Any] = (), usable: int | None = None) -> dict[str, Data]:
        return {"main": pareto_data(cs, fr), "headroom": headroom_data(cs, usable)}

    datas = data_fn(candidates, front, usable_bytes)
    source = ColumnDataSource(datas["main"], name="pareto")
    line_source = ColumnDataSource(datas["headroom"], name="pareto_headroom")
    fig = pan_zoom_figure("pareto_figure", "Planner: estimated peak vs estimated step time", width, height, 0.1)
    line = fig.line(
        x="ms",
        y="peak_bytes",
        source=line_source,
        line_color=LINE_COLOR,
        line_dash="dashed",
        line_width=1.5,
        name="headroom_line",
        legend_label="GPU less CUDA context",
    )
    points = fig.scatter(
        x="ms",
        y="peak_bytes",
        source=source,
        size="size",
        color="color",
        alpha=0.7,
        selection_color="#1f77b4",
        nonselection_alpha=0.3,
        name="pareto_points",
    )
    fig.text(
        x="ms",
        y="peak_bytes",
        text="stack_text",
        source=source,
        x_offset=7,
        y_offset=-4,
        text_font_size="9px",
        text_color="#555555",
        name="pareto_stacked",
    )
    legend_corner(fig)
    add_pick_tools(
        fig,
        points,
        [
            ("plan", "@label"),
            ("config", "@config"),
            ("peak", "@peak_label"),
            ("step", "@ms{0.00} ms"),
            ("plans here", "@stacked"),
            ("", "@fits"),
        ],
    )
    _bytes_axis(fig.yaxis[0])
    fig.yaxis.axis_label = "estimated peak"
    fig.xaxis.axis_label = "estimated step time (ms)"
    plot = Plot(fig, {"main": source, "headroom": line_source}, data_fn)
    plot.rule = line  # type: ignore[attr-defined]
    return plot
