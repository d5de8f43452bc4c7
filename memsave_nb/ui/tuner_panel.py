"""The "Fit a GPU" panel: a target (presets or a free value) with its headroom line, fits / does
not fit for the plan on display, the largest batch that fits, and the planner's Pareto front
(estimated peak vs estimated step time); clicking a point loads that plan into the explorer.

DOM hooks for browser tests: ``.memsave-target`` (dropdown), ``.memsave-target-gb`` (free value),
``.memsave-verdict`` (fits / does not fit), ``.memsave-max-batch`` (button) and
``.memsave-max-batch-result``, ``.memsave-plan-search`` (button), ``.memsave-tuner-status``,
``.memsave-tuner-code``; the scatter's points are the Bokeh renderer named ``pareto_points``.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Sequence

import ipywidgets as W
from bokeh.models import ColumnDataSource, DataRange1d, HoverTool, Span, TapTool
from bokeh.plotting import figure

from memsave_nb.errors import MemsaveError
from memsave_nb.target import DEFAULT_HEADROOM, HEADROOM_SOURCE, HEADROOM_WHY, PRESETS_GB, Target

from . import figures
from .format import format_bytes
from .plots import bokeh_widget

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.planner import Candidate, PlannerResult

    from .explorer import Explorer

FREE = "other…"
FITS_COLOR = "#2ca02c"
MISS_COLOR = "#d62728"


# -- the figure (pure: results in, Bokeh out) --------------------------------------------------
def pareto_data(candidates: Sequence["Candidate"], front: Sequence["Candidate"] = ()) -> figures.Data:
    on_front = {id(c) for c in front}
    data: figures.Data = {k: [] for k in ("index", "ms", "peak_bytes", "label", "peak_label", "fits", "color", "size", "config")}
    for i, c in enumerate(candidates):
        data["index"].append(i)
        data["ms"].append(c.est_seconds * 1e3)
        data["peak_bytes"].append(c.est_peak_bytes)
        data["label"].append(c.label)
        data["peak_label"].append(format_bytes(c.est_peak_bytes))
        data["fits"].append("fits" if c.fits else "does not fit")
        data["color"].append(FITS_COLOR if c.fits else MISS_COLOR)
        data["size"].append(11 if id(c) in on_front else 6)
        data["config"].append(c.config)
    return data


def pareto(candidates: Sequence["Candidate"], front: Sequence["Candidate"] = (), usable_bytes: int | None = None,
           *, width: int = 620, height: int = 380) -> figures.Plot:
    """Estimated peak against estimated step time, one point per candidate plan (front points
    larger; green fits, red does not), the headroom line as a horizontal rule."""

    def data_fn(cs: Sequence[Any], fr: Sequence[Any] = (), usable: int | None = None) -> dict[str, figures.Data]:
        return {"main": pareto_data(cs, fr)}

    source = ColumnDataSource(data_fn(candidates, front)["main"], name="pareto")
    fig = figure(width=width, height=height, title="Planner: estimated peak vs estimated step time",
                 tools="pan,wheel_zoom,box_zoom,save,reset", toolbar_location="above",
                 x_range=DataRange1d(range_padding=0.1), y_range=DataRange1d(range_padding=0.1), name="pareto_figure")
    points = fig.scatter(x="ms", y="peak_bytes", source=source, size="size", color="color", alpha=0.7,
                         selection_color="#1f77b4", nonselection_alpha=0.3, name="pareto_points")
    rule = Span(location=usable_bytes or 0, dimension="width", line_color="#555555", line_dash="dashed",
                visible=usable_bytes is not None, name="headroom_line")
    fig.add_layout(rule)
    fig.add_tools(TapTool(renderers=[points]))
    fig.add_tools(HoverTool(renderers=[points], tooltips=[("plan", "@label"), ("config", "@config"),
                                                          ("peak", "@peak_label"), ("step", "@ms{0.00} ms"), ("", "@fits")]))
    figures._bytes_axis(fig.yaxis[0])
    fig.yaxis.axis_label = "estimated peak"
    fig.xaxis.axis_label = "estimated step time (ms)"

    def after(plot: figures.Plot, new: dict[str, figures.Data], _rule: Any = rule) -> None:
        pass

    plot = figures.Plot(fig, {"main": source}, data_fn, after)
    plot.rule = rule  # type: ignore[attr-defined]
    return plot


# -- the panel ---------------------------------------------------------------------------------
class TunerPanel(W.VBox):
    """Target, verdict, max batch and the planner's front, wired to an :class:`Explorer`."""

    TITLE = "Fit a GPU"

    def __init__(self, explorer: "Explorer", *, device: str = "H100"):
        from memsave_nb.planner import GPUS

        self.explorer = explorer
        self.result: "PlannerResult | None" = None
        self.candidates: list["Candidate"] = []
        self._picking = False
        options = [(f"{g:g} GB", float(g)) for g in PRESETS_GB] + [(FREE, 0.0)]
        self.target_menu = W.Dropdown(options=options, value=24.0, description="my GPU", layout=W.Layout(width="200px"))
        self.target_menu.add_class("memsave-target")
        self.target_gb = W.BoundedFloatText(value=24.0, min=0.001, max=10000.0, step=1.0, description="GB",
                                            layout=W.Layout(width="160px"))
        self.target_gb.add_class("memsave-target-gb")
        self.headroom = W.BoundedFloatText(value=DEFAULT_HEADROOM, min=0.05, max=1.0, step=0.05, description="headroom",
                                           layout=W.Layout(width="170px"))
        self.device = W.Dropdown(options=list(GPUS), value=device, description="time on", layout=W.Layout(width="200px"))
        self.line = W.HTML("")
        self.verdict = W.HTML("")
        self.verdict.add_class("memsave-verdict")
        self.max_batch_button = W.Button(description="max batch", icon="arrows-v", layout=W.Layout(width="120px"))
        self.max_batch_button.add_class("memsave-max-batch")
        self.max_batch_result = W.HTML("")
        self.max_batch_result.add_class("memsave-max-batch-result")
        self.search_button = W.Button(description="find plans that fit", icon="search", button_style="info",
                                      layout=W.Layout(width="180px"))
        self.search_button.add_class("memsave-plan-search")
        self.status = W.HTML("")
        self.status.add_class("memsave-tuner-status")
        # workload knobs (memsave_nb.knobs): 0 / "as given" keeps the workload's own
        from memsave_nb.knobs import OPTIMIZERS, PRECISIONS

        small = W.Layout(width="150px")
        self.knob_batch = W.BoundedIntText(value=0, min=0, max=1 << 20, description="batch", layout=small)
        self.knob_seq = W.BoundedIntText(value=0, min=0, max=1 << 24, description="seq len", layout=small)
        self.knob_precision = W.Dropdown(options=[("as given", None)] + [(k, k) for k in PRECISIONS], value=None,
                                         description="precision", layout=W.Layout(width="220px"))
        self.knob_optimizer = W.Dropdown(options=[("as given", None)] + [(k, k) for k in OPTIMIZERS], value=None,
                                         description="optimizer", layout=W.Layout(width="220px"))
        self.knob_accumulate = W.BoundedIntText(value=1, min=1, max=1024, description="accumulate", layout=small)
        self.knob_apply = W.Button(description="apply knobs", icon="check", layout=W.Layout(width="120px"))
        self.knob_apply.add_class("memsave-knobs-apply")
        self.knob_apply.on_click(lambda _b: self.apply_knobs())
        self.code = W.HTML("")
        self.code.add_class("memsave-tuner-code")
        self.plot = pareto([], [], None)
        self.plot.source.selected.on_change("indices", self._tapped)
        note = W.HTML(f"<small>Fits means the measured peak stays under the headroom line: {html.escape(HEADROOM_WHY)}. "
                      f"Source of the 80% rule: {html.escape(HEADROOM_SOURCE)}. The planner works in fake mode; "
                      "click a point to load that plan into the explorer.</small>")
        self.target_menu.observe(self._menu_changed, "value")
        for w in (self.target_gb, self.headroom):
            w.observe(lambda _ch: self.refresh(), "value")
        self.max_batch_button.on_click(lambda _b: self.find_max_batch())
        self.search_button.on_click(lambda _b: self.search())
        super().__init__([
            W.HBox([self.target_menu, self.target_gb, self.headroom, self.device], layout=W.Layout(flex_flow="row wrap")),
            self.line,
            W.HBox([self.verdict]),
            W.HBox([self.knob_batch, self.knob_seq, self.knob_precision, self.knob_optimizer, self.knob_accumulate,
                    self.knob_apply], layout=W.Layout(flex_flow="row wrap")),
            W.HBox([self.max_batch_button, self.max_batch_result]),
            W.HBox([self.search_button, self.status]),
            bokeh_widget(self.plot.figure),
            note,
            self.code,
        ])
        self.add_class("memsave-tuner-panel")
        explorer.on_result(lambda _entry: self.refresh())
        self.refresh()

    # -- state -----------------------------------------------------------------------------------
    @property
    def target(self) -> Target:
        return Target(float(self.target_gb.value), float(self.headroom.value))

    def set_target(self, gb: float, headroom: float | None = None) -> None:
        """Choose a preset when ``gb`` is one, else the free value."""
        self.target_gb.value = float(gb)
        self.target_menu.value = float(gb) if float(gb) in PRESETS_GB else 0.0
        if headroom is not None:
            self.headroom.value = headroom
        self.refresh()

    def _menu_changed(self, change: dict) -> None:
        if change["new"]:
            self.target_gb.value = change["new"]

    def refresh(self) -> None:
        """Headroom line and the verdict for the measurement on display."""
        try:
            target = self.target
        except MemsaveError as exc:
            self._error(str(exc))
            return
        self.line.value = f"<small>plans must stay under <b>{format_bytes(target.usable_bytes)}</b> ({target.headroom:.0%} of {target.label})</small>"
        peak = self.explorer.measurement.peak_bytes
        color = FITS_COLOR if target.fits(peak) else MISS_COLOR
        self.verdict.value = f"<b style='color:{color}'>peak {format_bytes(peak)}: {html.escape(target.verdict(peak))}</b>"
        self.plot.rule.location = target.usable_bytes
        self.plot.rule.visible = True
        if self.candidates:
            for c in self.candidates:
                object.__setattr__(c, "fits", target.fits(c.est_peak_bytes))
            self.plot.update(self.candidates, self.result.front if self.result else ())

    def _error(self, text: str) -> None:
        self.status.value = f"<span style='color:{MISS_COLOR}'>{html.escape(text)}</span>"

    # -- actions ---------------------------------------------------------------------------------
    def apply_knobs(self) -> None:
        """Put the knob controls into the explorer's plan (which reruns when live)."""
        try:
            plan = self.explorer.plan.replace(
                batch_size=self.knob_batch.value or None,
                seq_len=self.knob_seq.value or None,
                precision=self.knob_precision.value,
                optimizer=self.knob_optimizer.value,
                accumulation_steps=self.knob_accumulate.value if self.knob_accumulate.value > 1 else None,
            )
        except MemsaveError as exc:
            self._error(str(exc))
            return
        self.explorer.set_plan(plan)

    def find_max_batch(self) -> int | None:
        from memsave_nb.target import max_batch

        try:
            r = max_batch(self.explorer.session.workload, self.explorer.plan, self.target)
        except MemsaveError as exc:
            self.max_batch_result.value = f"<span style='color:{MISS_COLOR}'>{html.escape(str(exc))}</span>"
            return None
        extra = f"; {r.limit}" if r.limit else ""
        self.max_batch_result.value = (f"max batch that fits: <b>{r.value}</b> (peak {format_bytes(r.peak_bytes or 0)}, "
                                       f"{r.count} fake-mode probes{html.escape(extra)})")
        return r.value

    def search(self, **options: Any) -> "PlannerResult | None":
        """Run the planner for the explorer's workload and the current plan's freezing."""
        from memsave_nb.planner import plan_for

        plan = self.explorer.plan
        self.status.value = "searching…"
        options.setdefault("precisions", (plan.precision, "bf16") if plan.precision != "bf16" else ("bf16",))
        try:
            result = plan_for(self.explorer.session.workload, self.target, mode="fake", device=self.device.value,
                              base_plan=plan.replace(regions={}), **options)
        except MemsaveError as exc:
            self._error(str(exc))
            return None
        self.result = result
        self.candidates = list(result.candidates)
        self._picking = True
        try:
            self.plot.update(self.candidates, result.front)
            self.plot.source.selected.indices = []
        finally:
            self._picking = False
        chosen = result.chosen
        self.status.value = html.escape(f"{len(result.candidates)} plans, {len(result.fitting)} fit; "
                                        + (f"chosen: {chosen.label}" if chosen else "none fits"))
        if chosen is not None:
            self._show_code(chosen)
        return result

    def pick(self, index: int) -> None:
        """Load candidate ``index`` into the explorer (what a click on its point does)."""
        if not 0 <= index < len(self.candidates):
            return
        c = self.candidates[index]
        self.explorer.set_plan(c.plan)
        self._show_code(c)

    def _show_code(self, c: "Candidate") -> None:
        self.code.value = (f"<small>{html.escape(c.label)}: estimated {format_bytes(c.est_peak_bytes)}, "
                           f"{c.est_seconds * 1e3:.2f} ms</small><pre>{html.escape(c.plan.to_code())}</pre>")

    def _tapped(self, _attr: str, _old: list[int], new: list[int]) -> None:
        if self._picking or not new:
            return
        self.pick(int(new[0]))
