"""Results of the current plan: the peak and its split with deltas, step time, the memory
timeline, saved activations per layer, and the history of plans tried (click a point to
restore that plan).

With a target GPU set (the "Fit a GPU" tab), the table's first row says whether this plan and the
baseline fit it by the panel's one verdict (``target.fit_of`` through ``ui/verdict.py``:
``.memsave-row-fits``, each verdict a ``.memsave-fits`` or ``.memsave-nofit`` span), and the
timeline draws the line that verdict faces (Bokeh ``Span`` named ``target_line``: what the replayed
step may reserve, or the 80% line without a replay; green when it fits, red when not) beside the
predicted reserved memory (``reserved_line``) and the live tensors (``.memsave-row-reserved`` in
the table).

DOM hooks: ``.memsave-results-table`` (the split table), and the Bokeh figures named
``peak_split_figure``, ``timeline_figure``, ``layer_bars_figure``, ``history_figure``.
"""

from __future__ import annotations

import html
from typing import Any, Callable, Sequence

import ipywidgets as W
from bokeh.models.annotations.geometry import Span  # where its stub declares it

from memsave_nb.measure import CATEGORIES, Measurement
from memsave_nb.target import Target

from . import figures
from .format import format_bytes, format_delta_bytes, format_time_spread, time_change
from .plots import bokeh_widget
from .verdict import fit_for, line_bytes, verdict_text


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return ""
    return f" ({a / b:.2f}x)"


def fits_html(target: Target, m: Measurement) -> str:
    """``fits`` / ``does not fit`` (``target.fit_of``, naming its rule: the panel's verdict) as a
    span with class ``memsave-fits`` or ``memsave-nofit``."""
    fit = fit_for(target, m)
    color = "#2ca02c" if fit.fits else "#d62728"
    return (
        f"<span class='{'memsave-fits' if fit.fits else 'memsave-nofit'}' style='color:{color};font-weight:bold'>"
        f"{html.escape(verdict_text(target, fit))}</span>"
    )


def results_html(m: Measurement, base: Measurement, target: Target | None = None) -> str:
    """The table of the peak's split, saved activations, step time and FLOPs against the baseline;
    with a ``target``, a first row with fits / does not fit for both peaks."""

    def row(label: str, now: int | None, before: int | None, cls: str = "") -> str:
        delta = None if now is None or before is None else now - before
        color = "#888" if not delta else ("#2ca02c" if delta < 0 else "#d62728")
        c = f' class="{cls}"' if cls else ""
        return (
            f"<tr{c}><td>{html.escape(label)}</td><td style='text-align:right'>{format_bytes(now)}</td>"
            f"<td style='text-align:right'>{format_bytes(before)}</td>"
            f"<td style='text-align:right;color:{color}'>{format_delta_bytes(delta) if delta else '='}</td></tr>"
        )

    first, first_base = getattr(m, "first_step_peak_bytes", None), getattr(base, "first_step_peak_bytes", None)
    steady = first is not None and first != m.peak_bytes
    rows = [row("peak (steady-state step)" if steady else "peak", m.peak_bytes, base.peak_bytes, "memsave-row-peak")]
    if steady:
        rows.append(row("peak of the first step", first, first_base, "memsave-row-first-peak"))
    for c in CATEGORIES:
        rows.append(row(f"  {c.replace('_', ' ')} at peak", getattr(m.peak_split, c), getattr(base.peak_split, c)))
    rows.append(row("saved activations (for backward)", m.saved_bytes, base.saved_bytes, "memsave-row-saved"))
    outputs, outputs_base = int(getattr(m, "output_bytes", 0) or 0), int(getattr(base, "output_bytes", 0) or 0)
    if outputs or outputs_base:
        rows.append(row("outputs and caches kept (not for backward)", outputs, outputs_base, "memsave-row-outputs"))
    reserved = [getattr(getattr(x, "reserved", None), "max_reserved_bytes", None) for x in (m, base)]
    if reserved != [None, None]:  # the allocator model's prediction beside the tensors' peak
        rows.append(row("predicted reserved (allocator model)", reserved[0], reserved[1], "memsave-row-reserved"))
    if m.cuda_peak_bytes is not None or base.cuda_peak_bytes is not None:
        rows.append(row("CUDA allocator peak", m.cuda_peak_bytes, base.cuda_peak_bytes, "memsave-row-cuda"))
    step = (
        f"<tr class='memsave-row-time'><td>step time (median)</td><td style='text-align:right'>{format_time_spread(m)}</td>"
        f"<td style='text-align:right'>{format_time_spread(base)}</td>"
        f"<td style='text-align:right'>{html.escape(time_change(m, base))}</td></tr>"
    )
    flops = (
        f"<tr><td>FLOPs</td><td style='text-align:right'>{m.flops:.3g}</td>"
        f"<td style='text-align:right'>{base.flops:.3g}</td>"
        f"<td style='text-align:right'>{_ratio(m.flops, base.flops).strip(' ()')}</td></tr>"
    )
    if target is not None:
        rows.insert(
            0,
            (
                f"<tr class='memsave-row-fits'><td>{html.escape(target.label)} GPU</td>"
                f"<td style='text-align:right'>{fits_html(target, m)}</td>"
                f"<td style='text-align:right'>{fits_html(target, base)}</td><td></td></tr>"
            ),
        )
    head = "<tr><th></th><th>this plan</th><th>baseline</th><th>change</th></tr>"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in m.notes)
    return (
        f"<table style='border-collapse:collapse;font-size:90%'>{head}{''.join(rows)}{step}{flops}</table>"
        + (f"<ul style='font-size:85%;color:#555'>{notes}</ul>" if notes else "")
        + f"<div style='font-size:85%;color:#555'>peak during {html.escape(m.peak_phase or '-')}; "
        f"{html.escape(m.mode)} mode on {html.escape(m.device)}; step time is the median of the timed steps "
        '(min–max beside it); a change within that spread reads "same"</div>'
    )


class ResultsPanel(W.VBox):
    def __init__(
        self,
        baseline_entry: Any,
        on_pick: Callable[[int], None] | None = None,
        first_step: tuple[bool, Callable[[bool], None]] | None = None,
    ):
        """``first_step``: the first-step switch's value and what it calls (the explorer's
        ``show_first_step_peak``); None: no switch."""
        # Figures start with the data they first show: BokehModel renders its document as it was
        # when the widget was made, and a change sent before the front end has a view is lost.
        baseline = baseline_entry.measurement
        self._on_pick = on_pick
        self._picking = False
        self.table = W.HTML()
        self.table.add_class("memsave-results-table")
        self.target: Target | None = None  # set by the explorer (the "Fit a GPU" tab's target)
        self._shown: tuple[Measurement, Measurement] = (baseline, baseline)
        self.peak_plot = figures.peak_split(baseline, baseline)
        self.timeline_plot = figures.timeline(baseline)
        self._timeline_m = baseline
        self.zoom = W.ToggleButtons(
            options=[("whole step", ""), ("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer")],
            value="",
            style={"button_width": "110px"},
            tooltips=["the whole step", "zoom on forward", "zoom on backward", "zoom on the optimizer step"],
        )
        self.zoom.add_class("memsave-timeline-zoom")
        self.zoom.observe(lambda _ch: self._zoom(), "value")
        # the target's headroom line on the timeline (drawn when the peak comes near it)
        self.target_line = Span(
            location=0,
            dimension="width",
            line_color="#d62728",
            line_dash="dashed",
            line_width=1.5,
            visible=False,
            name="target_line",
        )
        self.timeline_plot.figure.add_layout(self.target_line)
        self.layers_plot = figures.layer_bars(baseline, baseline)
        self.history_plot = figures.history([baseline_entry], 0)
        self.history_plot.source.selected.on_change("indices", self._tapped)
        # training's first step measured too (its peak beside the steady state's): one more step per run
        self.first_step = W.Checkbox(
            value=bool(first_step and first_step[0]),
            indent=False,
            description="also measure training's first step (one more step per run)",
            layout=W.Layout(width="auto", display="" if first_step else "none"),
        )
        self.first_step.add_class("memsave-first-step-switch")
        if first_step is not None:
            self.first_step.observe(lambda ch, switch=first_step[1]: switch(bool(ch["new"])), "value")
        super().__init__(
            [
                self.first_step,
                # side by side when there is room; in a narrow notebook the plot goes under the table
                W.HBox(
                    [self.table, bokeh_widget(self.history_plot.figure)],
                    layout=W.Layout(align_items="flex-start", flex_flow="row wrap"),
                ),
                bokeh_widget(self.peak_plot.figure),
                W.HBox(
                    [W.HTML("<small>timeline:</small>"), self.zoom],
                    layout=W.Layout(align_items="center", flex_flow="row wrap"),
                ),
                bokeh_widget(self.timeline_plot.figure),
                bokeh_widget(self.layers_plot.figure),
            ]
        )
        self.add_class("memsave-results")

    def show(self, m: Measurement, base: Measurement) -> None:
        self._shown = (m, base)
        self.show_table()
        self.peak_plot.update(m, base)
        self.timeline_plot.update(m)
        self._timeline_m = m
        self._zoom()
        self.layers_plot.update(m, base)

    def show_table(self) -> None:
        """Rewrite the table and the timeline's headroom line (after a new measurement or target)."""
        m, base = self._shown
        self.table.value = results_html(m, base, self.target)
        if self.target is None:
            self.target_line.visible = False
        else:  # the line the verdict faces: reserved memory's (the GPU less the context) or the 80% line
            fit = fit_for(self.target, m)
            self.target_line.location = line_bytes(self.target, fit)
            self.target_line.line_color = "#2ca02c" if fit.fits else "#d62728"
            self.target_line.visible = True

    def set_target(self, target: Target | None) -> None:
        self.target = target
        self.show_table()

    def _zoom(self) -> None:
        """Show one phase of the timeline across the whole width (or the whole step)."""
        figures.zoom_timeline(self.timeline_plot, self._timeline_m, self.zoom.value or None)

    def show_history(self, entries: Sequence[Any], current: int | None) -> None:
        self._picking = True
        try:
            self.history_plot.update(list(entries), current)
            self.history_plot.source.selected.indices = []
        finally:
            self._picking = False

    def _tapped(self, _attr: str, _old: list[int], new: list[int]) -> None:
        if self._picking or not new or self._on_pick is None:
            return
        self._on_pick(int(new[0]))
