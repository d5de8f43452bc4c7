"""The GPUs tab's picture of one ``ParallelMeasurement`` (pure: a result in, HTML and Bokeh out):
a stacked bar per distinct rank group by category, the lines no counter sees as a hatched range
above it, the GPU's usable line, a fits / does not fit verdict against the Fit-a-GPU target, and
a table with units chosen per value.

Bokeh names: figure ``gpus_figure``, stacks ``gpus_bar_<category>``, ``gpus_unseen`` (hatched),
``gpus_usable_line`` (the 80% rule's usable share, or where every rank was replayed through the
allocator model the whole GPU less the CUDA context and communication buffers; the hatched range then
holds the replay's rounding and cached segments); ``.memsave-parallel-replay`` says the verdict is the
replay's, ``.memsave-parallel-rule`` that it is the 80% rule (no replay: the cross-check's rebuilt
ranks, the layout search's shallow twins; pipeline stages are replayed too).

The layout planner's answer (``planner.plan_layout``) has its picture here too: every candidate as
estimated peak per GPU against estimated step time, the front and the chosen layout
(``layout_figure``, ``layout_fit``, ``layout_nofit``, ``layout_front``, ``layout_chosen``,
``layout_usable_line``), and the front as a table (``.memsave-layout-front``, the chosen row
``.memsave-layout-chosen``); a pipeline layout says its stages and its bubble (hover and table), and
a rank's label says which stages it holds.
"""

from __future__ import annotations

import html
from typing import Any

from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Range1d, Span
from bokeh.plotting import figure

from memsave_nb.parallel.result import CATEGORIES, stages_of, unseen_lines
from memsave_nb.parallel.verdict import worst_fit
from memsave_nb.target import COMM_BUFFER_SOURCE, CUDA_CONTEXT_SOURCE, Target, replay_line_bytes

from .format import format_bytes
from .plot_base import _bytes_axis

COLORS = ("#1f77b4", "#aec7e8", "#9467bd", "#17becf", "#ff7f0e", "#d62728", "#2ca02c", "#8c564b", "#7f7f7f")
FITS_COLOR = "#2ca02c"
MISS_COLOR = "#d62728"


def category_name(category: str, strategy: str) -> str:
    """A column's words: DDP keeps a whole replica, which is no shard."""
    if category == "sharded_parameters":
        return "parameters (replica)" if strategy == "ddp" else "parameters (shards)"
    if category == "unsharded_parameters":
        return "parameters (gathered)"
    return category.replace("_", " ")


def rank_label(ranks: tuple[int, ...], spec: Any = None) -> str:
    """A rank group in words; under pipeline stages (``spec``) with the stages it holds."""
    if len(ranks) == 1:
        words = f"rank {ranks[0]}"
    elif list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        words = f"ranks {ranks[0]}-{ranks[-1]}"
    else:
        words = f"{len(ranks)} ranks from {ranks[0]}"
    stages = stages_of(spec, ranks[0]) if spec is not None else ()
    if stages:
        words += f" (stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))})"
    return words


def _split(result: Any, r: Any) -> dict[str, int]:
    if result.host_peak_bytes is not None:
        return dict(r.device_peak_split or {})
    return dict(r.peak_split)


def _unseen(result: Any, r: Any) -> tuple[int, int]:
    """The unseen lines for this rank's own peak (the fragmentation line scales with it)."""
    reserved = None if getattr(r, "reserved", None) is None else r.reserved.max_reserved_bytes
    lines = unseen_lines(
        result.spec, r.device_bytes, r.offload_h2d_bytes, r.offload_d2h_bytes, r.foreach_temp_bytes, reserved
    )
    return sum(u.low_bytes for u in lines), sum(u.high_bytes for u in lines)


def _replayed(result: Any) -> bool:
    return all(getattr(r, "reserved", None) is not None for r in result.ranks)


def _line_bytes(result: Any, target: Target) -> int:
    """The dashed line: where every rank was replayed, what a rank may reserve (the whole GPU less the
    CUDA context and communication buffers); else the 80% rule's usable share."""
    if _replayed(result):
        return replay_line_bytes(target, result.spec.communicators)
    return target.usable_bytes


def columns(result: Any) -> list[str]:
    return [c for c in CATEGORIES if any(_split(result, r).get(c) for r in result.ranks)]


def rank_figure(result: Any, target: Target | None, *, width: int = 640, height: int = 320) -> Any:
    """One stacked bar per rank group; the hatched range is the unseen lines (low to high)."""
    labels = [rank_label(r.ranks, result.spec) for r in result.ranks]
    cols = columns(result)
    data: dict[str, list] = {"rank": labels}
    for c in cols:
        data[c] = [_split(result, r).get(c, 0) for r in result.ranks]
    data["counted"] = [r.device_bytes for r in result.ranks]
    data["counted_label"] = [format_bytes(v) for v in data["counted"]]
    lows, highs = zip(*(_unseen(result, r) for r in result.ranks))
    data["unseen_bottom"] = list(data["counted"])
    data["unseen_top"] = [c + h for c, h in zip(data["counted"], highs)]
    data["unseen_label"] = [f"{format_bytes(lo)} .. {format_bytes(hi)}" for lo, hi in zip(lows, highs)]
    source = ColumnDataSource(data, name="gpus")
    top = max(
        data["unseen_top"]
        + (
            [
                _line_bytes(result, target),
            ]
            if target
            else []
        )
        + [1]
    )
    fig = figure(
        x_range=FactorRange(*labels),
        y_range=Range1d(0, top * 1.12),
        width=width,
        height=height,
        toolbar_location=None,
        title=f"Per-rank GPU memory: {result.spec.describe()}",
        name="gpus_figure",
    )
    strategy = getattr(result.spec, "strategy", "fsdp")
    fig.vbar_stack(
        cols,
        x="rank",
        width=0.6,
        source=source,
        color=list(COLORS[: len(cols)]),
        legend_label=[category_name(c, strategy) for c in cols],
        name=[f"gpus_bar_{c}" for c in cols],
    )
    unseen = fig.vbar(
        x="rank",
        bottom="unseen_bottom",
        top="unseen_top",
        width=0.6,
        source=source,
        fill_alpha=0.0,
        hatch_pattern="/",
        hatch_color="#888888",
        hatch_alpha=0.8,
        line_color="#888888",
        line_dash="dashed",
        legend_label="unseen lines (up to)",
        name="gpus_unseen",
    )
    fig.add_tools(
        HoverTool(
            renderers=[unseen],
            tooltips=[("ranks", "@rank"), ("counted", "@counted_label"), ("unseen", "@unseen_label")],
        )
    )
    if target is not None:
        fig.add_layout(
            Span(
                location=_line_bytes(result, target),
                dimension="width",
                line_color="#333333",
                line_dash="dashed",
                line_width=2,
                name="gpus_usable_line",
            )
        )
    _bytes_axis(fig.yaxis[0])
    fig.yaxis.axis_label = "bytes per GPU"
    legend = fig.legend[0]
    legend.label_text_font_size = "9px"
    fig.add_layout(legend, "right")  # beside the bars, never over them
    return fig


def verdict_html(result: Any, target: Target | None) -> str:
    """Fits / does not fit against the target. Where the ranks were replayed through the allocator
    model: the deciding rank's predicted reserved memory + CUDA context + communication buffers,
    each with its source, against the whole GPU (no 80% rule). Else the 80% rule on the worst
    rank's counted peak, labelled (``NO_RANK_REPLAY``)."""
    worst = result.worst
    counted = worst.device_bytes
    where = " on the GPU" if result.host_peak_bytes is not None else ""
    if target is None:
        return (
            f"<span class='memsave-parallel-verdict'>worst {rank_label(worst.ranks, result.spec)}: {format_bytes(counted)} counted"
            f"{where}; set a GPU size in <i>Fit a GPU</i> for a verdict</span>"
        )
    rank, fit = worst_fit(target, result)
    if fit.replay is not None:
        return _replay_html(result, target, rank, fit)
    low, high = _unseen(result, worst)
    ok = target.fits(counted)
    whole = counted + high <= target.total_bytes
    extra = (
        f"; with the unseen lines {format_bytes(counted + low)} .. {format_bytes(counted + high)}, "
        f"{'within' if whole else 'over'} the whole {html.escape(target.label)}"
    )
    return (
        f"<b class='memsave-parallel-verdict {'memsave-fits' if ok else 'memsave-nofit'}' "
        f"style='color:{FITS_COLOR if ok else MISS_COLOR}'>worst {rank_label(worst.ranks, result.spec)}: "
        f"{format_bytes(counted)}{where} {html.escape(target.verdict(counted))}</b><small>{extra}</small>"
        f"<br><small class='memsave-parallel-rule'>{NO_RANK_REPLAY}</small>"
    )


def _replay_html(result: Any, target: Target, rank: Any, fit: Any) -> str:
    v = fit.replay
    ok = fit.fits
    word = "fits" if ok else "does not fit"
    parts = [
        f"predicted reserved {format_bytes(v.reserved_bytes)}",
        f"CUDA context {format_bytes(v.context_bytes)}",
    ]
    if v.communicators:
        parts.append(f"communication buffers {format_bytes(v.comm_bytes)}")
    head = (
        f"<b class='memsave-parallel-verdict {'memsave-fits' if ok else 'memsave-nofit'}' "
        f"style='color:{FITS_COLOR if ok else MISS_COLOR}'>{rank_label(rank.ranks, result.spec)}: "
        f"{' + '.join(parts)} = {format_bytes(v.total_bytes)}, {word} the whole {html.escape(target.label)}</b>"
    )
    r = rank.reserved
    fix = f"; PYTORCH_CUDA_ALLOC_CONF={html.escape(v.fix)} fits" if v.fix else ""
    streams = 1 + max(getattr(rank, "reserved_streams", ()), default=0)
    sources = (
        f"reserved: this rank's allocations replayed through the caching-allocator model ({streams} stream"
        f"{'s' * (streams > 1)}; counted peak {format_bytes(rank.device_bytes)}, fragmentation at the allocated "
        f"peak {format_bytes(r.fragmentation_bytes)}{', cuBLAS workspace inside' if v.workspace_bytes else ''}); "
        f"CUDA context: {html.escape(CUDA_CONTEXT_SOURCE)}"
        + (f"; buffers: {v.communicators} x {html.escape(COMM_BUFFER_SOURCE)}" if v.communicators else "")
    )
    return f"{head}<small>{fix}</small><br><small class='memsave-parallel-replay'>{RANK_REPLAY}: {sources}</small>"


# where every rank was replayed through the allocator model (parallel/replay.py)
RANK_REPLAY = "allocator replay per rank, no 80% rule"
# where a rank carries no allocator replay (sized with replay=False, rebuilt from a cross-check's
# JSON): said, not invented
NO_RANK_REPLAY = (
    "80% rule: these per-rank steps were not replayed through the allocator model, so no "
    "predicted reserved memory per rank; the verdict is the counted peak under 80% of the GPU"
)


def table_html(result: Any) -> str:
    """Per rank group: device peak, predicted reserved (the allocator replay), host peak under
    offload, each category; then the unseen lines.
    Scrolls sideways in a narrow page with the rank column fixed."""
    cols = columns(result)
    strategy = getattr(result.spec, "strategy", "fsdp")
    offload = result.host_peak_bytes is not None
    replayed = _replayed(result)
    heads = ["ranks", "GPU peak" if offload else "peak"] + (["predicted reserved"] if replayed else [])
    heads += (["host peak"] if offload else []) + [category_name(c, strategy) for c in cols]
    sticky = "position:sticky;left:0;background:var(--jp-layout-color0, #fff);"
    cell = "padding:2px 8px;text-align:right;white-space:nowrap;"
    th = "".join(f"<th style='{cell}{sticky if i == 0 else ''}'>{html.escape(h)}</th>" for i, h in enumerate(heads))
    rows = []
    for r in result.ranks:
        values = (
            [r.device_bytes]
            + ([r.reserved.max_reserved_bytes] if replayed else [])
            + ([r.host_peak_bytes or 0] if offload else [])
            + [_split(result, r).get(c, 0) for c in cols]
        )
        tds = "".join(f"<td style='{cell}'>{format_bytes(v)}</td>" for v in values)
        rows.append(
            f"<tr><td style='{cell}{sticky}text-align:left'>{html.escape(rank_label(r.ranks, result.spec))}</td>{tds}</tr>"
        )
    unseen = "".join(
        f"<li title='{html.escape(u.source)}'>{html.escape(u.name)}: {format_bytes(u.low_bytes)} .. "
        f"{format_bytes(u.high_bytes)}</li>"
        for u in result.unseen
    )
    state = "steady state" if result.steady else "first step"
    # the widget's content box would grow to the table's width: let it shrink, the grid box scrolls
    fit = ".memsave-parallel-table .widget-html-content{min-width:0;width:100%;overflow:hidden}"
    return (
        f"<style>{fit}</style><div class='memsave-parallel-grid-box' style='overflow-x:auto;max-width:100%'>"
        f"<div><small>{html.escape(result.spec.describe())} ({state})"
        f"{'; GPU = device memory, host = CPU memory' if offload else ''}</small></div>"
        f"<table class='memsave-parallel-grid' style='border-collapse:collapse;font-size:12px'>"
        f"<thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        f"<small>Lines no counter sees, per GPU of the worst rank (hover for the source):</small>"
        f"<ul style='margin:2px 0;font-size:12px'>{unseen}</ul>"
    )


def _layout_points(candidates: list) -> dict[str, list]:
    return {
        "peak": [c.est_peak_bytes for c in candidates],
        "seconds": [c.step_seconds for c in candidates],
        "label": [c.label for c in candidates],
        "peak_label": [format_bytes(c.est_peak_bytes) for c in candidates],
        "time_label": [f"{c.step_seconds:.3g} s" for c in candidates],
        "bubble_label": [_bubble(c) or "none" for c in candidates],
    }


def _bubble(c: Any) -> str:
    """A pipeline candidate's idle share of its step (1F1B's bubble, in its estimated time)."""
    if c.pipeline_stages <= 1:
        return ""
    return f"{c.pipeline_stages} stages, bubble {c.bubble_seconds:.3g} s of {c.step_seconds:.3g} s"


def layout_figure(result: Any, *, width: int = 640, height: int = 320) -> Any:
    """Every candidate layout: estimated peak per GPU (x) against estimated step time (y); those that
    fit, those that do not, the Pareto front of those that fit, the chosen one, the usable line."""
    fig = figure(
        width=width,
        height=height,
        toolbar_location=None,
        name="layout_figure",
        title=f"Layouts over {result.gpus} x {result.device.name}: estimated peak per GPU vs step time",
    )
    renderers = []
    for name, color, group in (
        ("layout_fit", FITS_COLOR, [c for c in result.candidates if c.fits]),
        ("layout_nofit", MISS_COLOR, [c for c in result.candidates if not c.fits]),
    ):
        source = ColumnDataSource(_layout_points(group))
        renderers.append(
            fig.scatter(
                "peak",
                "seconds",
                source=source,
                size=7,
                color=color,
                alpha=0.6,
                name=name,
                legend_label="fits" if name == "layout_fit" else "does not fit",
            )
        )
    front = ColumnDataSource(_layout_points(result.front))
    fig.line("peak", "seconds", source=front, color="#333333", line_width=2, name="layout_front", legend_label="front")
    if result.chosen is not None:
        chosen = ColumnDataSource(_layout_points([result.chosen]))
        renderers.append(
            fig.scatter(
                "peak",
                "seconds",
                source=chosen,
                size=14,
                marker="star",
                color="#ff7f0e",
                name="layout_chosen",
                legend_label="chosen",
            )
        )
    fig.add_layout(
        Span(
            location=result.target.usable_bytes,
            dimension="height",
            line_color="#333333",
            line_dash="dashed",
            line_width=2,
            name="layout_usable_line",
        )
    )
    fig.add_tools(
        HoverTool(
            renderers=renderers,
            tooltips=[
                ("layout", "@label"),
                ("peak", "@peak_label"),
                ("step", "@time_label"),
                ("pipeline", "@bubble_label"),
            ],
        )
    )
    _bytes_axis(fig.xaxis[0])
    fig.xaxis.axis_label = "estimated peak per GPU"
    fig.yaxis.axis_label = "estimated step time (s)"
    fig.legend[0].label_text_font_size = "9px"
    return fig


def layout_front_html(result: Any) -> str:
    """The front of the layouts that fit, lowest peak first; the chosen row marked."""
    if not result.front:
        return "<div class='memsave-layout-front'><i>no layout fits</i></div>"
    cell = "padding:2px 8px;white-space:nowrap;"
    rows = []
    for c in result.front:
        chosen = result.chosen is not None and c.label == result.chosen.label
        mark = " class='memsave-layout-chosen' style='font-weight:bold'" if chosen else ""
        rows.append(
            f"<tr{mark}><td style='{cell}text-align:right'>{format_bytes(c.est_peak_bytes)}</td>"
            f"<td style='{cell}text-align:right'>{c.step_seconds:.3g} s</td>"
            f"<td style='{cell}'>{html.escape(c.label)}{' (chosen)' if chosen else ''}"
            f"{f' <small>({html.escape(_bubble(c))})</small>' if _bubble(c) else ''}</td></tr>"
        )
    head = "".join(f"<th style='{cell}'>{h}</th>" for h in ("est. peak per GPU", "est. step", "layout"))
    return (
        f"<table class='memsave-layout-front' style='border-collapse:collapse;font-size:12px'>"
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )
