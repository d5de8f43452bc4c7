"""The per-layer figure: the bytes each module keeps at the end of forward, one horizontal bar per
leaf (and per parent's own bytes), the bars beyond ``top`` summed into one (re-exported by
``figures.py``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from bokeh.models import ColumnDataSource, DataRange1d, FactorRange
from bokeh.models.annotations import LabelSet
from bokeh.plotting import figure

from ..measure.result import Measurement
from .format import format_bytes, format_delta_bytes, format_share, format_shape
from .plot_base import (
    BAR_COLOR,
    CATEGORY_COLORS,
    LESS_COLOR,
    MORE_COLOR,
    ROOT_LABEL,
    Data,
    Plot,
    _bytes_axis,
    add_hover,
)


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


class _Bar(NamedTuple):
    """One bar before it becomes columns: its bytes kept and, of those, outputs and caches."""

    name: str
    label: str
    type_name: str
    depth: int
    shape: str
    kept: int
    outputs: int


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
    bars = _module_bars(measurement, leaves_only)
    others: tuple[int, int, int] | None = None  # how many bars summed, their bytes, their outputs
    if top is not None and len(bars) > max(0, top):
        keep_n = max(0, top - 1) if top > 0 else 0
        kept_idx = set(sorted(range(len(bars)), key=lambda i: -bars[i].kept)[:keep_n])
        rest = [b for i, b in enumerate(bars) if i not in kept_idx]
        others = (len(rest), sum(b.kept for b in rest), sum(b.outputs for b in rest))
        bars = [b for i, b in enumerate(bars) if i in kept_idx]
    base_rows: dict[str, int] = {}
    if baseline is not None:
        before_data = layer_bars_data(baseline, leaves_only=leaves_only)
        base_rows = dict(zip(before_data["name"], before_data["saved_bytes"]))
    data: Data = {k: [] for k in _COLUMNS}
    for bar in bars:
        _add_bar(data, bar, total, base_rows.get(bar.name) if baseline is not None else None, baseline is not None)
    if others is not None:
        count, kept, outputs = others
        before = None
        if baseline is not None:
            shown = set(data["name"])
            before = sum(v for n, v in base_rows.items() if n not in shown)
        bar = _Bar(OTHERS_NAME, f"+{count} others", "", 0, "-", kept, outputs)
        _add_bar(data, bar, total, before, baseline is not None)
    return data


OTHERS_NAME = "*others*"
_COLUMNS = (
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


def _module_bars(measurement: Measurement, leaves_only: bool) -> list[_Bar]:
    """One bar per leaf and per parent's own bytes (``leaves_only``), else per module rolled up."""
    bars = []
    for m in measurement.modules:
        saved, outputs = kept_bytes(m, own=leaves_only)
        shape = format_shape(m.output_shape)
        if not leaves_only or m.is_leaf:
            bars.append(
                _Bar(m.name, layer_label(m.name, m.type_name), m.type_name, m.depth, shape, saved + outputs, outputs)
            )
        elif saved or outputs:
            name = f"{m.name} (own)" if m.name else "(own)"
            bars.append(
                _Bar(name, own_label(m.name, m.type_name), m.type_name, m.depth, shape, saved + outputs, outputs)
            )
    return bars


def _add_bar(data: Data, bar: _Bar, total: int, before: int | None, has_baseline: bool) -> None:
    """Append one bar's columns: its share of ``total`` and its change against ``before``."""
    kept, outputs = bar.kept, bar.outputs
    share = kept / total if total else 0.0
    before = kept if before is None else before
    delta = kept - before
    data["name"].append(bar.name)
    data["label"].append(bar.label)
    data["type_name"].append(bar.type_name)
    data["depth"].append(bar.depth)
    data["output_shape"].append(bar.shape)
    data["saved_bytes"].append(kept)
    data["backward_bytes"].append(kept - outputs)
    data["output_bytes"].append(outputs)
    data["saved_label"].append(format_bytes(kept))
    data["share"].append(share)
    data["share_label"].append(format_share(share))
    data["baseline_bytes"].append(before)
    data["delta_bytes"].append(delta)
    data["delta_label"].append(format_delta_bytes(delta) if has_baseline else "")
    text = f"{format_bytes(kept)} ({format_share(share)})"
    if outputs:
        text += f", outputs {format_bytes(outputs)}"
    if has_baseline and delta:
        text += f"  {format_delta_bytes(delta)}"
    data["text"].append(text)
    data["color"].append(BAR_COLOR if delta == 0 else (MORE_COLOR if delta > 0 else LESS_COLOR))


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
    add_hover(
        fig,
        [bars],
        [
            ("module", "@name"),
            ("type", "@type_name"),
            ("output", "@output_shape"),
            ("kept", "@saved_label"),
            ("share", "@share_label"),
            ("vs baseline", "@delta_label"),
        ],
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
