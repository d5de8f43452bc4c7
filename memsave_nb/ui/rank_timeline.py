"""The GPUs tab's timeline of one rank: the allocator model's allocated bytes (solid) and reserved
bytes (dashed) after each of the rank's tracked events, as the single-GPU timeline draws its
reserved line (``timeline_figure.py``); one rank at a time, the deciding rank first (a selector in
``parallel_panel.py`` picks another). Pure: a ``ParallelMeasurement`` in, a ``Plot`` out.

Why the allocator's allocated and not the counted live bytes: a ``RankMeasurement`` keeps no
per-event split, and the replay's two series are what ``torch.cuda.memory_allocated`` and
``memory_reserved`` would read on that rank, so their gap is the rank's cached memory.

Bokeh names: figure ``gpus_timeline_figure``, lines ``gpus_allocated_line`` and
``gpus_reserved_line``, the whole GPU less context and buffers ``gpus_timeline_line``.
"""

from __future__ import annotations

from typing import Any

from bokeh.models import ColumnDataSource, Range1d
from bokeh.models.annotations import Span
from bokeh.plotting import figure

from memsave_nb.parallel.replay import rank_series
from memsave_nb.parallel.verdict import worst_fit
from memsave_nb.target import Target, replay_line_bytes

from .format import format_bytes
from .parallel_view import rank_label
from .plot_base import MAX_TIMELINE_POINTS, Data, Plot, _bytes_axis, add_hover, legend_below
from .timeline_figure import downsample_indices

ALLOCATED_COLOR = "#1f77b4"
RESERVED_COLOR = "#9467bd"


def replayed_indices(result: Any) -> list[int]:
    """Positions in ``result.ranks`` of the ranks that carry an allocator replay."""
    return [i for i, r in enumerate(result.ranks) if getattr(r, "reserved", None) is not None and r.reserved.ops]


def deciding_index(result: Any, target: Target | None) -> int | None:
    """The rank the verdict rests on (``worst_fit``; no target: the largest predicted reserved), or
    None where no rank was replayed."""
    replayed = replayed_indices(result)
    if not replayed:
        return None
    if target is not None:
        rank, _ = worst_fit(target, result, fixes=False)
        at = next((i for i, r in enumerate(result.ranks) if r is rank), None)
        if at in replayed:
            return at
    return max(replayed, key=lambda i: (result.ranks[i].reserved.max_reserved_bytes, -result.ranks[i].rank))


def rank_choices(result: Any) -> list[tuple[str, int]]:
    """(label, position) of every replayed rank, for the selector."""
    return [(rank_label(result.ranks[i].ranks, result.spec), i) for i in replayed_indices(result)]


def rank_timeline_data(rank: Any, max_points: int = MAX_TIMELINE_POINTS) -> Data:
    """Columns: ``x`` (the rank's event index), ``allocated`` and ``reserved`` bytes after it (long
    steps downsampled keeping both maxima exactly), and their labels."""
    allocated, reserved = rank_series(rank)
    keep = [max(range(len(s)), key=s.__getitem__) for s in (allocated, reserved) if s]
    idx = downsample_indices(allocated, max_points, keep) if allocated else []
    return {
        "x": idx,
        "allocated": [allocated[i] for i in idx],
        "reserved": [reserved[i] for i in idx],
        "allocated_label": [format_bytes(allocated[i]) for i in idx],
        "reserved_label": [format_bytes(reserved[i]) for i in idx],
    }


def _title(result: Any, index: int) -> str:
    r = result.ranks[index]
    return (
        f"{rank_label(r.ranks, result.spec)}: allocated and reserved over the step "
        f"(peak reserved {format_bytes(r.reserved.max_reserved_bytes)})"
    )


def rank_timeline(
    result: Any, index: int, target: Target | None = None, *, width: int = 640, height: int = 260
) -> Plot:
    """One replayed rank's timeline (``index`` into ``result.ranks``); ``Plot.update(result, i)``
    shows another rank in the same figure."""

    def data_fn(res: Any, i: int) -> dict[str, Data]:
        return {"main": rank_timeline_data(res.ranks[i])}

    datas = data_fn(result, index)
    source = ColumnDataSource(datas["main"], name="gpus_timeline")
    comms = result.spec.communicators if result.spec.world_size > 1 else 0  # as ``worst_fit`` counts them
    line = replay_line_bytes(target, comms) if target is not None else 0
    fig = figure(
        width=width,
        height=height,
        title=_title(result, index),
        y_range=Range1d(start=0, end=_top(datas["main"], line)),
        tools="xpan,xwheel_zoom,box_zoom,save,reset",
        toolbar_location="above",
        name="gpus_timeline_figure",
    )
    allocated = fig.step(
        x="x",
        y="allocated",
        source=source,
        mode="after",
        color=ALLOCATED_COLOR,
        line_width=1.5,
        legend_label="allocated (allocator model)",
        name="gpus_allocated_line",
    )
    fig.step(
        x="x",
        y="reserved",
        source=source,
        mode="after",
        color=RESERVED_COLOR,
        line_width=1.5,
        line_dash="dashed",
        legend_label="reserved (allocator model)",
        name="gpus_reserved_line",
    )
    if target is not None:
        fig.add_layout(
            Span(
                location=line,
                dimension="width",
                line_color="#333333",
                line_dash="dotted",
                line_width=2,
                name="gpus_timeline_line",
            )
        )
    add_hover(
        fig,
        [allocated],
        [("event", "@x"), ("allocated", "@allocated_label"), ("reserved", "@reserved_label")],
        mode="vline",
    )
    _bytes_axis(fig.yaxis[0])
    fig.xaxis.axis_label = "the rank's allocation / free events"
    fig.yaxis.axis_label = "bytes on the GPU"
    legend_below(fig)

    def after(plot: Plot, new: dict[str, Data]) -> None:
        plot.figure.y_range.start, plot.figure.y_range.end = 0, _top(new["main"], line)

    return Plot(fig, {"main": source}, data_fn, after)


def _top(data: Data, line: int) -> float:
    """The y range's end: the data, and the verdict's line where it is near (under twice the data's
    top); a line far above would flatten both series to the axis (a small model on an 80 GB GPU)."""
    top = max(data["reserved"] + data["allocated"] + [1])
    return max(top, line if line <= 2 * top else 0) * 1.12


def show_rank(plot: Plot, result: Any, index: int) -> None:
    """Switch the figure to another replayed rank (its data and title)."""
    plot.update(result, index)
    plot.figure.title.text = _title(result, index)
