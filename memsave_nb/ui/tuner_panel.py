"""The "Fit a GPU" panel: a target (presets or a free value), fits / does not fit for the plan on
display by ``target.fit_of`` (``ui/verdict.py``: the allocator replay's predicted reserved memory +
CUDA context against the GPU, each part shown with its source; the headroom line only where a step
has no replay, and the panel says which rule decided), the workload knobs of the plan on display, the largest batch that
fits, and the planner's Pareto front (estimated peak vs estimated step time) as a scatter and as a
list; clicking a point (or an entry's "load") loads that plan into the explorer, which reruns it,
and the knob controls follow.

The planner and the max-batch bisection run on a worker thread (:class:`~.runner.Runner`: the
newest request wins, cancel stops the running one at its next measurement, the model is restored
by ``Plan.apply``); the status line shows what runs and for how long, an error is one line there.
``panel.wait()`` blocks until the work is done (tests, scripts); ``background=False`` runs it in
the calling thread.

The target is also the explorer's (``Explorer.set_target``): its header and the Results table
say fits / does not fit for every peak shown.

DOM hooks for browser tests: ``.memsave-target`` (dropdown), ``.memsave-target-gb`` (free value),
``.memsave-verdict`` (fits / does not fit; inside it ``.memsave-verdict-parts`` and
``.memsave-verdict-reserved``), ``.memsave-rule`` (the line and its rule), ``.memsave-max-batch`` (button) and
``.memsave-max-batch-result``, ``.memsave-plan-search`` (button), ``.memsave-tuner-cancel``,
``.memsave-tuner-status``, ``.memsave-tuner-progress`` (what runs, elapsed seconds),
``.memsave-tuner-code``, ``.memsave-knob-batch`` / ``-seq`` / ``-precision`` / ``-optimizer`` /
``-accumulate`` / ``-zero-grad`` / ``-loss``, ``.memsave-front-list`` with one ``.memsave-front-row`` per
front plan (``.memsave-fits`` or ``.memsave-nofit``; ``.memsave-front-picked`` on the loaded one)
holding ``.memsave-front-text`` and a ``.memsave-front-load`` button; ``.memsave-max-seq`` and
``.memsave-max-seq-result`` (token workloads only); the scatter's points are the
Bokeh renderer named ``pareto_points`` (figure ``pareto_figure``).
"""

from __future__ import annotations

import html
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import ipywidgets as W
from memsave_nb.errors import MemsaveError
from memsave_nb.plan import Plan
from memsave_nb.target import PRESETS_GB, Target, estimate_fits, replay_line_bytes

from .format import format_bytes
from .front_list import FrontList
from .pareto_figure import FITS_COLOR, MISS_COLOR, pareto, pareto_data  # noqa: F401 - pareto_data: public here too
from .plots import bokeh_widget
from .sized import no_seq_reason  # noqa: F401 - public here too (named models' batches can be searched)
from .tuner_controls import (  # noqa: F401 - public here too
    AS_GIVEN,
    FREE,
    ZERO_GRAD_CHOICES,
    KnobControls,
    SearchControls,
    TargetControls,
    fit_note,
)
from .tuner_host import TunerHost
from .tuner_text import _floor, _hints_count, _hints_html, _notes_html  # noqa: F401 - public here too
from .tuner_work import TunerWork, one_line  # noqa: F401 - one_line: public here too
from .verdict import fit_for, opening_gb, parts_html, rule_html, verdict_text

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.planner import Candidate, PlannerResult
    from memsave_nb.target import Fit


class Found(NamedTuple):
    """A search's answer (``result``: target.py's SearchResult) and the plan and target it was for."""

    plan: Plan
    target: Target
    result: Any


def _no_target_text(explorer: TunerHost) -> str:
    return (
        f"no target yet: no single GPU of the presets holds this step's parameters, gradients and optimizer "
        f"state ({format_bytes(_floor(explorer.measurement))}); shard it (GPUs tab) or freeze most of it, "
        "or pick a size"
    )


class TunerPanel(W.VBox):
    """Target, verdict, knobs, max batch and the planner's front, wired to a :class:`TunerHost`
    (the explorer). The controls are built in ``ui/tuner_controls.py``, the background work runs
    in ``ui/tuner_work.py``; this class says what they show."""

    TITLE = "Fit a GPU"

    def __init__(self, explorer: TunerHost, *, device: str = "H100"):
        self.explorer = explorer
        self.result: "PlannerResult | None" = None
        self.candidates: list["Candidate"] = []
        self.front_indices: list[int] = []  # index into candidates of each front-list entry
        self.picked: int | None = None
        self.max_batch: Found | None = None  # the last max-batch search
        self.max_seq: Found | None = None  # the last max-seq-len search
        self._picking = False
        self._syncing = False
        self._drawn_for: Target | None = None  # the target the scatter was last drawn for
        self.fit: "Fit | None" = None  # target.fit_of for the measurement on display (ui/verdict.py), after refresh
        self._planner_fits: list[bool] = []  # the planner's own fits per candidate, for its own target
        self.hints: list = []  # what_would_fit's answer when a search found nothing that fits
        # background work: the newest request wins (ui/runner.py); a generation marks stale results
        self.work = TunerWork(explorer._ui_lock)
        self.runner, self.status, self.progress_text = self.work.runner, self.work.status, self.work.progress_text
        self.cancel_button = self.work.cancel_button

        # the target starts at the smallest preset the step fits (target.fit_of); none when no preset
        # holds even its weights, gradients and optimizer state (a 70B opened at "24 GB: 2685%")
        start_gb = opening_gb(explorer.measurement)
        self.no_target: str | None = None if start_gb is not None else _no_target_text(explorer)
        self.targets = TargetControls.build(start_gb or float(max(PRESETS_GB)), device)
        self.target_menu, self.target_gb = self.targets.menu, self.targets.gb
        self.headroom, self.device = self.targets.headroom, self.targets.device
        # the controls keep their old names on the panel (tests, notebooks and the docs read them)
        self.knobs = k = KnobControls.build()
        self.knob_batch, self.knob_seq, self.knob_precision = k.batch, k.seq, k.precision
        self.knob_optimizer, self.knob_accumulate, self.knob_zero_grad = k.optimizer, k.accumulate, k.zero_grad
        self.knob_loss, self.knob_apply = k.loss, k.apply
        self.searches = sc = SearchControls.build()
        self.max_batch_button, self.max_batch_result = sc.max_batch_button, sc.max_batch_result
        self.max_seq_button, self.max_seq_result = sc.max_seq_button, sc.max_seq_result
        self.search_button = sc.search_button
        self.line = W.HTML("")
        self.verdict = _classed_html("memsave-verdict")
        self.code = _classed_html("memsave-tuner-code")
        self.hints_box = _classed_html("memsave-tuner-hints")
        self.plot = pareto([], [], None)
        self.front_list = FrontList(self.pick)
        super().__init__(self._rows())
        self.add_class("memsave-tuner-panel")
        self._wire()
        why_no_seq = no_seq_reason(explorer.session.workload)
        if why_no_seq:
            sc.disable_seq(why_no_seq)
        explorer.on_result(lambda _entry: self.refresh())
        explorer.editor.on_change(self.sync_knobs)  # a loaded or edited plan: the knob controls follow
        self.sync_knobs()
        self.refresh()

    def _rows(self) -> list[W.Widget]:
        sc = self.searches
        return [
            self.targets.row(),
            self.line,
            W.HBox([self.verdict]),
            self.knobs.row(),
            W.HBox([sc.max_batch_button, sc.max_batch_result], layout=W.Layout(align_items="center")),
            W.HBox([sc.max_seq_button, sc.max_seq_result], layout=W.Layout(align_items="center")),
            W.HBox(
                [sc.search_button, self.cancel_button, self.progress_text, self.status],
                layout=W.Layout(align_items="center", flex_flow="row wrap"),
            ),
            self.hints_box,
            W.HBox([bokeh_widget(self.plot.figure), self.front_list], layout=W.Layout(flex_flow="row wrap")),
            fit_note(),
            self.code,
        ]

    def _wire(self) -> None:
        self.knob_apply.on_click(lambda _b: self.apply_knobs())
        self.plot.source.selected.on_change("indices", self._tapped)
        self.target_menu.observe(self._menu_changed, "value")
        self.target_gb.observe(self._gb_changed, "value")
        self.headroom.observe(lambda _ch: self._target_chosen(), "value")
        self.max_batch_button.on_click(lambda _b: self.find_max_batch(background=True))
        self.max_seq_button.on_click(lambda _b: self.find_max_seq_len(background=True))
        self.search_button.on_click(lambda _b: self.search(background=True))

    @property
    def state(self) -> str:
        """idle, waiting, running, done, cancelled or error: the status line's first word."""
        return self.work.state

    @property
    def error(self) -> str | None:
        """The last error's line (None unless the status says error)."""
        return self.work.error

    # -- state -----------------------------------------------------------------------------------
    @property
    def target(self) -> Target:
        return Target(float(self.target_gb.value), float(self.headroom.value))

    @property
    def busy(self) -> bool:
        return self.runner.busy

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the scheduled and running search / max-batch work is done; False on timeout."""
        return self.runner.wait(timeout)

    def set_target(self, gb: float, headroom: float | None = None) -> None:
        """Choose a preset when ``gb`` is one, else the free value."""
        if headroom is not None:
            self.headroom.value = headroom
        self.target_gb.value = float(gb)
        self._target_chosen()

    def _target_chosen(self) -> None:
        """The user set a size or a headroom: from now on there is a target."""
        self.no_target = None
        self.refresh()

    def _menu_changed(self, change: dict) -> None:
        if change["new"] == self.target_gb.value and self.no_target:
            self._target_chosen()  # the preset shown while there was no target, chosen now
        if change["new"] and change["new"] != self.target_gb.value:
            self.target_gb.value = change["new"]

    def _gb_changed(self, change: dict) -> None:
        gb = float(change["new"])
        menu = gb if gb in PRESETS_GB else 0.0
        if self.target_menu.value != menu:
            self.target_menu.value = menu
        self._target_chosen()

    def sync_knobs(self) -> None:
        """Show the workload knobs of the explorer's plan in the knob controls."""
        plan = self.explorer.plan
        with self.explorer._ui_lock:
            self._syncing = True
            try:
                self.knobs.show(plan)
            finally:
                self._syncing = False

    def refresh(self) -> None:
        """Headroom line, the verdict for the measurement on display, the explorer's target, the
        front's fits / does not fit, and whether the max batch shown is for the plan on display."""
        try:
            target = self.target
        except MemsaveError as exc:
            self._set_status("error", str(exc))
            return
        if self.no_target:
            with self.explorer._ui_lock:
                self.line.value = f"<small class='memsave-no-target'>{html.escape(self.no_target)}</small>"
                self.verdict.value = ""
                if self.explorer.target is not None:
                    self.explorer.set_target(None)
            return
        with self.explorer._ui_lock:
            fit = self.fit = fit_for(target, self.explorer.measurement)
            self.line.value = rule_html(target, fit)
            self.verdict.value = (
                f"<b class='{'memsave-fits' if fit.fits else 'memsave-nofit'}' "
                f"style='color:{FITS_COLOR if fit.fits else MISS_COLOR}'>"
                f"{html.escape(target.label)}: {html.escape(verdict_text(target, fit))}</b><br>" + parts_html(fit)
            )
            if self.explorer.target != target:
                self.explorer.set_target(target)
            # the scatter is redrawn only when the target moved: a redraw after every run made the
            # browser echo the selection back, and a second run followed each click
            if self._drawn_for != target:
                self._drawn_for = target
                self._judge_candidates(target)
                self._redraw()
                self._show_front()
            self._show_max_batch()

    def _show_max_batch(self) -> None:
        if self.max_batch is None:
            return
        plan, target, r = self.max_batch
        if self.explorer.max_batch_shown() is None:
            self.max_batch_result.value = (
                f"<small style='color:#888'>max batch {r.value} was for "
                f"{html.escape(plan.describe())} at {html.escape(target.label)} "
                f"({target.headroom:.0%}); press <i>max batch</i> for the plan on display</small>"
            )
            return
        extra = f"; {r.limit}" if r.limit else ""
        self.max_batch_result.value = (
            f"max batch that fits: <b>{r.value}</b> (peak {format_bytes(r.peak_bytes or 0)}, "
            f"{r.count} fake-mode probes, {html.escape(r.rule or 'no probe measured')}{html.escape(extra)})"
            + _notes_html(r)
        )

    # -- background work (ui/tuner_work.py) ----------------------------------------------------
    def _set_status(self, state: str, text: str = "") -> None:
        self.work.set_status(state, text)

    def _submit(self, label: str, work: Any, done: Any, background: bool) -> Any:
        return self.work.submit(label, work, done, background)

    def cancel(self) -> bool:
        """Stop the running search / max batch at its next measurement (the model is restored)."""
        return self.work.cancel()

    # -- actions ---------------------------------------------------------------------------------
    def apply_knobs(self) -> None:
        """Put the knob controls into the explorer's plan (which reruns when live)."""
        try:
            plan = self.knobs.plan_from(self.explorer.plan)
        except MemsaveError as exc:
            self._set_status("error", str(exc))
            return
        self.explorer.set_plan(plan)

    def find_max_batch(self, *, background: bool = False) -> int | None:
        """The largest batch that fits the target under the explorer's plan (bisection in fake
        mode). ``background=True`` (the button) runs it on the worker and returns None."""
        from memsave_nb.target import max_batch

        workload, plan, target = self.explorer.session.workload, self.explorer.plan, self.target

        def work(ev: threading.Event) -> Any:
            return max_batch(workload, plan, target, cancel_event=ev)

        def done(r: Any) -> str:
            self.max_batch = Found(plan, target, r)
            self.explorer.set_max_batch(plan, target, r.value)
            self._show_max_batch()
            if self.explorer.max_batch_shown() is None:  # the plan on display is not the one searched
                extra = f"; {r.limit}" if r.limit else ""
                self.max_batch_result.value = (
                    f"max batch that fits: <b>{r.value}</b> (peak {format_bytes(r.peak_bytes or 0)}, "
                    f"{r.count} fake-mode probes, {html.escape(r.rule or 'no probe measured')}"
                    f"{html.escape(extra)}; for "
                    f"{html.escape(plan.describe())}, not yet measured)" + _notes_html(r)
                )
            return f"max batch {r.value} at {target.label} ({r.count} probes)"

        r = self._submit("max batch: bisection in fake mode", work, done, background)
        return r.value if r is not None else None

    def find_max_seq_len(self, *, background: bool = False) -> int | None:
        """The longest token sequence that fits the target under the explorer's plan (bisection in
        fake mode, capped by the model's positions). ``background=True`` (the button) runs it on the
        worker and returns None."""
        from memsave_nb.target import max_seq_len

        workload, plan, target = self.explorer.session.workload, self.explorer.plan, self.target

        def work(ev: threading.Event) -> Any:
            return max_seq_len(workload, plan, target, cancel_event=ev)

        def done(r: Any) -> str:
            self.max_seq = Found(plan, target, r)
            extra = f"; {r.limit}" if r.limit else ""
            self.max_seq_result.value = (
                f"max sequence length that fits: <b>{r.value}</b> (peak "
                f"{format_bytes(r.peak_bytes or 0)}, {r.count} fake-mode probes, "
                f"{html.escape(r.rule or 'no probe measured')}{html.escape(extra)}; "
                f"for {html.escape(plan.describe() or 'the workload as given')} at "
                f"{html.escape(target.label)})" + _notes_html(r)
            )
            return f"max sequence length {r.value} at {target.label} ({r.count} probes)"

        r = self._submit("max sequence length: bisection in fake mode", work, done, background)
        return r.value if r is not None else None

    def search(self, *, background: bool = False, **options: Any) -> "PlannerResult | None":
        """Run the planner for the explorer's workload and the current plan's freezing; options go
        to :func:`memsave_nb.planner.plan_for`. ``background=True`` (the button) runs it on the
        worker and returns None; the result is then ``panel.result`` once ``panel.wait()`` returns."""
        from memsave_nb.planner import plan_for

        plan, target, device = self.explorer.plan, self.target, self.device.value
        workload = self.explorer.session.workload
        options.setdefault("precisions", (plan.precision, "bf16") if plan.precision != "bf16" else ("bf16",))

        def work(ev: threading.Event) -> "PlannerResult":
            result = plan_for(
                workload,
                target,
                mode="fake",
                device=device,
                base_plan=plan.replace(regions={}),
                cancel_event=ev,
                **options,
            )
            self.hints = []
            if result.chosen is None and not result.fitting:  # nothing fits: which knob would, on its own
                from memsave_nb.planner import what_would_fit

                self.hints = what_would_fit(workload, plan, target, cancel_event=ev)
            return result

        return self._submit("searching plans (fake mode)", work, self._show_result, background)

    def _show_result(self, result: "PlannerResult") -> str:
        self.result = result
        self.candidates = list(result.candidates)
        self._planner_fits = [c.fits for c in self.candidates]
        self.picked = None
        self._picking = True
        try:
            self._redraw()
            self.plot.source.selected.indices = []
        finally:
            self._picking = False
        by_id = {id(c): i for i, c in enumerate(self.candidates)}
        self.front_indices = [by_id[id(c)] for c in result.front if id(c) in by_id]
        self.front_list.set_front([self.candidates[i] for i in self.front_indices], self.front_indices)
        self._show_front()
        chosen = result.chosen
        if chosen is not None:
            self._show_code(chosen)
        self.hints_box.value = _hints_html(self.hints, result.target) if chosen is None else ""
        return (
            f"{len(result.candidates)} plans, {len(result.fitting)} fit; "
            + (f"chosen: {chosen.label}" if chosen else "none fits" + _hints_count(self.hints))
            + f" ({self.work.waited(result.seconds):.1f} s)"
        )

    @property
    def front_rows(self) -> list[W.HBox]:
        """One list row per front plan, in the front's order (lowest estimated peak first)."""
        return self.front_list.rows

    def _judge_candidates(self, target: Target) -> None:
        """Each candidate's fits for ``target``: the planner's own answer for the target it searched
        (its re-measured plans judged by ``fit_of``), else the estimate against the line the replay
        faces (``estimate_fits``, as the planner judges an estimate)."""
        same = self.result is not None and self.result.target == target
        for i, c in enumerate(self.candidates):
            ok = (
                self._planner_fits[i]
                if same and i < len(self._planner_fits)
                else estimate_fits(target, c.est_peak_bytes)
            )
            object.__setattr__(c, "fits", ok)

    def _redraw(self) -> None:
        self._drawn_for = None if self.no_target else self.target
        line = None if self._drawn_for is None else replay_line_bytes(self._drawn_for)
        self.plot.update(self.candidates, self.result.front if self.result else (), line)

    def _show_front(self) -> None:
        """Each front entry's text and fits / does not fit class (after a search or a new target)."""
        rows = self.front_indices
        picked = rows.index(self.picked) if self.picked in rows else None
        self.front_list.show([self.candidates[i] for i in rows], picked)

    def pick(self, index: int) -> None:
        """Load candidate ``index`` into the explorer (what a click on its point or its list entry's
        "load" does): every control, the knob controls included, shows that plan, and the explorer
        reruns it as any plan edit (when live)."""
        if not 0 <= index < len(self.candidates):
            return
        c = self.candidates[index]
        self.picked = index
        with self.explorer._ui_lock:
            self._picking = True
            try:
                if list(self.plot.source.selected.indices) != [index]:
                    self.plot.source.selected.indices = [index]
            finally:
                self._picking = False
            self._show_front()
            self._show_code(c)
        self.explorer.set_plan(c.plan)
        self.sync_knobs()

    def _show_code(self, c: "Candidate") -> None:
        self.code.value = (
            f"<small>{html.escape(c.label)}: estimated {format_bytes(c.est_peak_bytes)}, "
            f"{c.est_seconds * 1e3:.2f} ms</small><pre>{html.escape(c.plan.to_code(loop=self.explorer.session.workload.loop))}</pre>"
        )

    def _tapped(self, _attr: str, _old: list[int], new: list[int]) -> None:
        if self._picking or not new:
            return
        index = int(new[0])
        if (
            index == self.picked
            and 0 <= index < len(self.candidates)
            and _same(self.explorer.plan, self.candidates[index].plan)
        ):
            return  # the selection echoed back (a redraw, a second event per tap): the plan is loaded already
        self.pick(index)


def _same(a: Any, b: Any) -> bool:
    return a.replace(name="") == b.replace(name="")


def _classed_html(cls: str) -> W.HTML:
    w = W.HTML("")
    w.add_class(cls)
    return w
