"""The notebook explorer: edit a Plan with widgets, watch the Session measure it.

``explore(model, batch)`` (or ``explore(workload)``) opens it. Every control edits a
:class:`~memsave_nb.ui.editor.PlanEditor`; a change schedules a rerun after a short debounce on
a worker thread (the kernel stays responsive), shows progress, can be cancelled, and shows a
failure inside the widget while the model stays as it was (the Session and Plan guarantee that).
The explorer holds no measurement logic: numbers come from the Session's Measurements.

Hooks for scripts and tests: ``explorer.wait()`` blocks until the reruns are done,
``explorer.run_now()`` measures the current plan synchronously, ``live=False`` turns automatic
reruns off. DOM classes for browser tests: ``.memsave-explorer`` (the whole widget),
``.memsave-saved-total`` (saved activations, formatted), ``.memsave-saved-bytes`` (the same in
bytes, ``"27,028,744 B"``), ``.memsave-peak-total`` / ``.memsave-peak-bytes``,
``.memsave-status`` (``idle``, ``running``, ``done``, ``cancelled``, ``error`` as its first word),
``.memsave-error``, ``.memsave-cancel``, ``.memsave-run``, ``.memsave-plan-code``,
``.memsave-progress-text`` (phase and elapsed seconds of a run), ``.memsave-summary`` (the header
numbers), ``.memsave-advice``, ``.memsave-loss-note``, ``.memsave-bokeh`` (each figure widget),
``.memsave-target-verdict`` (fits / does not fit the "Fit a GPU" tab's target, with the class
``memsave-fits`` or ``memsave-nofit``, and the max batch once found for the plan on display), and
per module ``.memsave-freeze-<slug>`` (see :mod:`memsave_nb.ui.layer_table`).

A run that fails leaves the numbers of the last good run on screen, puts the controls back to that
run's plan (a failing toggle does not stay on) and never shows the failed plan as code.
"""

from __future__ import annotations

import html
import threading
import weakref
from typing import Any, Callable

import ipywidgets as W
from torch import nn

from memsave_nb.errors import MemsaveError, WorkloadError
from memsave_nb.measure import Measurement
from memsave_nb.measure.common import sized_words
from memsave_nb.plan import Plan
from memsave_nb.session import Entry, Session
from memsave_nb.target import Target
from memsave_nb.workload import Workload

from .budget_panel import BudgetPanel
from .editor import PlanEditor
from .explorer_runs import ExplorerRuns
from .explorer_text import _delta_text, loss_note_html, output_kind, title_html  # noqa: F401 - public here too
from .format import format_bytes, format_time_spread, time_change
from .layer_table import LayerTable, tied_by_module
from .plots import bokehjs_loader
from .results_panel import ResultsPanel
from .runner import Runner
from .sac_panel import SacPanel
from .sized import batch_words
from .styles import explorer_style, narrow_tables_style
from .verdict import show_header_verdict, show_reserved

__all__ = ["Explorer", "explore", "last_explorer"]

_last_explorer: "weakref.ref[Explorer] | None" = None


def last_explorer() -> "Explorer | None":
    """The explorer made last in this process (``%memsave_report`` reports its session)."""
    return _last_explorer() if _last_explorer is not None else None


TAB_TITLES = ("Layers", "SAC per op", "Compile budget", "Results", "Plan as code", "GPUs")


def _label(value: str, cls: str, **layout: Any) -> W.Label:
    # as wide as the text (a Label's default inline width spreads the header over two lines)
    layout = {"width": "auto", "flex": "0 0 auto", "margin": "0 4px 0 0", **layout}
    w = W.Label(value=value, layout=W.Layout(**layout))
    w.add_class(cls)
    return w


class Explorer(ExplorerRuns, W.VBox):
    """Widgets over a :class:`~memsave_nb.session.Session`.

    Parameters: ``session``; ``live`` (rerun on every change, default True); ``debounce_s``
    (quiet time before a rerun starts); ``max_open_rows`` (rows shown expanded at first).
    """

    def __init__(self, session: Session, *, live: bool = True, debounce_s: float = 0.3, max_open_rows: int = 40):
        self.session = session
        self.model: nn.Module = session.workload.model
        self.editor = PlanEditor(self.model)
        self.runner = Runner(debounce_s)
        self.error: str | None = None
        self.entry: Entry | None = None
        self.sweep_points: list[tuple[float, Measurement]] = []
        self._ui_lock = threading.RLock()
        self._user_cancelled = False
        self._restoring = False
        self._syncing = False
        self._listeners: list[Callable[[Entry], None]] = []
        self._generation = 0  # bumped by every request; a run shows its result only if still the newest

        base_entry = session.baseline_entry
        self.baseline: Measurement = base_entry.measurement

        # -- header: numbers, status, controls -------------------------------------------------
        wl = session.workload
        self.title = W.HTML(self._title_for(None))
        self.title.add_class("memsave-title")
        self.saved_total = _label("-", "memsave-saved-total")
        self.saved_bytes = _label("-", "memsave-saved-bytes")
        self.saved_delta = _label("", "memsave-saved-delta")
        self.peak_total = _label("-", "memsave-peak-total")
        self.peak_bytes = _label("-", "memsave-peak-bytes")
        self.peak_delta = _label("", "memsave-peak-delta")
        self.output_kept = _label("", "memsave-output-bytes", display="none")
        self.first_step = _label("", "memsave-first-step-peak", display="none")
        self.reserved = _label("", "memsave-reserved", display="none")  # the allocator model's, ui/verdict.py
        self.step_time = _label("-", "memsave-step-time")
        self.cuda_peak = _label("", "memsave-cuda-peak", display="none")
        # fits / does not fit the target GPU (set in the "Fit a GPU" tab), and its max batch when found
        self.target: Target | None = None
        self._max_batch: tuple[Plan, Target, int] | None = None
        self.target_verdict = _label("", "memsave-target-verdict", display="none")
        # two designed lines (memory; time) rather than one that wraps anywhere
        memory_row = W.HBox(
            [
                W.HTML("<b>saved</b>", layout=W.Layout(flex="0 0 auto", margin="0 6px 0 0")),
                self.saved_total,
                self.saved_bytes,
                self.saved_delta,
                self.output_kept,
                W.HTML("<b>peak</b>", layout=W.Layout(flex="0 0 auto", margin="0 6px 0 8px")),
                self.peak_total,
                self.peak_bytes,
                self.peak_delta,
                self.first_step,
                self.reserved,
            ],
            layout=W.Layout(flex_flow="row wrap", align_items="center"),
        )
        time_row = W.HBox(
            [
                W.HTML("<b>step</b>", layout=W.Layout(flex="0 0 auto", margin="0 6px 0 0")),
                self.step_time,
                self.cuda_peak,
                self.target_verdict,
            ],
            layout=W.Layout(flex_flow="row wrap", align_items="center"),
        )
        for row in (memory_row, time_row):
            row.add_class("memsave-summary-row")
        self.summary = W.VBox([memory_row, time_row])
        self.summary.add_class("memsave-summary")
        self.advice = W.HTML("", layout=W.Layout(display="none"))
        self.advice.add_class("memsave-advice")
        self.loss_note = W.HTML(loss_note_html(wl, session.mode))
        self.loss_note.add_class("memsave-loss-note")

        self.status = W.HTML("idle")
        self.status.add_class("memsave-status")
        self.progress = W.IntProgress(
            value=0, min=0, max=1, layout=W.Layout(width="160px", visibility="hidden", flex="0 0 auto")
        )
        self.progress.add_class("memsave-progress")
        self.progress_text = W.HTML("")
        self.progress_text.add_class("memsave-progress-text")
        # fixed widths that do not shrink: at 700 px the buttons keep their words
        self.cancel_button = W.Button(
            description="cancel",
            icon="stop",
            disabled=True,
            layout=W.Layout(width="100px", min_width="100px", flex="0 0 auto"),
        )
        self.cancel_button.add_class("memsave-cancel")
        self.run_button = W.Button(
            description="run",
            icon="play",
            layout=W.Layout(width="90px", min_width="90px", flex="0 0 auto"),
            tooltip="measure the current plan now",
        )
        self.run_button.add_class("memsave-run")
        self.live = W.Checkbox(
            value=live,
            description="live reruns",
            indent=False,
            layout=W.Layout(width="120px", min_width="110px", flex="0 0 auto"),
        )
        self.live.add_class("memsave-live")
        self.status_bar = W.HBox(
            [self.run_button, self.cancel_button, self.live, self.progress, self.progress_text, self.status],
            layout=W.Layout(align_items="center", flex_flow="row wrap"),
        )
        self._run_started: float | None = None
        self._progress_label = ""
        self._ticker: threading.Thread | None = None
        self.error_box = W.HTML("", layout=W.Layout(display="none"))
        self.error_box.add_class("memsave-error")

        # -- whole-model toolbar -------------------------------------------------------------------
        try:
            from memsave_nb.presets import presets_for

            self._presets = presets_for(wl)  # the workload: no input-only preset for token-id batches
        except Exception:  # noqa: BLE001 - presets are a convenience; the explorer works without
            self._presets = {}
        self.preset = W.Dropdown(
            options=[("plan preset…", "")] + [(k, k) for k in self._presets], value="", layout=W.Layout(width="220px")
        )
        self.preset.add_class("memsave-preset")
        self.input_grad = W.Checkbox(
            value=bool(getattr(wl, "input_requires_grad", False)),
            description="input requires grad",
            indent=False,
            layout=W.Layout(width="160px"),
        )
        self.input_grad.add_class("memsave-input-grad")
        self.bn_eval = W.Checkbox(
            value=False, description="batch norm in eval mode", indent=False, layout=W.Layout(width="190px")
        )
        self.bn_eval.add_class("memsave-bn-eval")
        self.reset_button = W.Button(description="reset plan", icon="undo", layout=W.Layout(width="110px"))
        self.reset_button.add_class("memsave-reset")

        # -- panels ------------------------------------------------------------------------------
        self.table = LayerTable(
            self.editor, max_open_rows=max_open_rows, on_select=self._on_select, tied=tied_by_module(self.model)
        )
        self._unsavable: list | None = None
        self.sac = SacPanel(self.editor, unsavable=self._unsavable_in)
        self.budget = BudgetPanel(
            self.editor,
            on_sweep=self.sweep,
            disabled_reason=("fake tensors do not compile: open the explorer in real mode to try a compile budget")
            if session.mode == "fake"
            else "",
        )
        self.results = ResultsPanel(
            base_entry, on_pick=self._on_pick, first_step=(session.first_step_peak, self.show_first_step_peak)
        )
        self.code = W.HTML()
        self.code.add_class("memsave-plan-code")
        self.code_text = ""
        self._failed_plan: Plan | None = None  # the plan whose last run failed: never exported
        self.plan_json = W.Textarea(layout=W.Layout(width="100%", height="120px"))
        self.plan_json.add_class("memsave-plan-json")
        layers_tab = W.VBox(
            [
                W.HBox(
                    [
                        self.preset,
                        self.input_grad,
                        self.bn_eval,
                        self.reset_button,
                        self.table.expand_all,
                        self.table.collapse_all,
                    ],
                    layout=W.Layout(flex_flow="row wrap"),
                ),
                self.table,
            ]
        )
        code_tab = W.VBox(
            [
                W.HTML("<small>Run this once after building the model (before building the optimizer):</small>"),
                self.code,
                W.HTML("<small>The plan as JSON (<code>Plan.from_json</code> reads it back):</small>"),
                self.plan_json,
            ]
        )
        from .parallel_panel import ParallelPanel

        # per-rank sizing, on demand; judged against the "Fit a GPU" target
        self.gpus = ParallelPanel(session.workload, plan_fn=lambda: self.plan, target_fn=lambda: self.target)
        self.tabs = W.Tab(children=[layers_tab, self.sac, self.budget, self.results, code_tab, self.gpus])
        self.tuner = None  # the "Fit a GPU" panel (ui/tuner_panel.py), added once the wiring below is done
        for i, t in enumerate(TAB_TITLES):
            self.tabs.set_title(i, t)

        super().__init__(
            [
                bokehjs_loader(),
                explorer_style(),
                narrow_tables_style(),
                self.title,
                self.summary,
                self.advice,
                self.loss_note,
                self.status_bar,
                self.error_box,
                self.tabs,
            ]
        )
        self.add_class("memsave-explorer")

        # -- wiring ------------------------------------------------------------------------------
        self.editor.on_change(self._on_edit)
        self.run_button.on_click(lambda _b: self.rerun())
        self.cancel_button.on_click(lambda _b: self.cancel())
        self.live.observe(lambda ch: self.rerun() if ch["new"] and self.state == "changed" else None, "value")
        self.preset.observe(self._user_preset, "value")
        self.input_grad.observe(self._user_input_grad, "value")
        self.bn_eval.observe(lambda ch: None if self._syncing else self.editor.set_bn_eval(ch["new"]), "value")
        self.reset_button.on_click(lambda _b: self.set_plan(Plan()))

        self._show(base_entry)
        self._show_code()
        from .tuner_panel import TunerPanel

        self.tuner = TunerPanel(self)
        self.tabs.children = (*self.tabs.children, self.tuner)
        self.tabs.set_title(len(self.tabs.children) - 1, TunerPanel.TITLE)
        self._set_status("idle", "baseline measured")
        global _last_explorer
        _last_explorer = weakref.ref(self)

    def _title_for(self, plan: Plan | None) -> str:
        """The title for the plan on display: its batch and sequence follow the plan's knobs."""
        wl = self.session.workload
        return title_html(
            getattr(wl, "name", "workload"),
            type(self.model).__name__,
            self.session.mode,
            str(getattr(wl, "device", "cpu")),
            wl.loop,
            wl.sized_for,
            batch_words(wl, plan),
            html.escape(sized_words(getattr(getattr(self, "baseline", None), "notes", ()))),
        )

    # -- public API ----------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan the controls describe now."""
        return self.editor.plan()

    @property
    def measurement(self) -> Measurement:
        """The measurement on display."""
        return self.entry.measurement if self.entry is not None else self.baseline

    @property
    def busy(self) -> bool:
        return self.runner.busy

    def set_plan(self, plan: Plan) -> None:
        """Set every control from ``plan`` (and rerun when live)."""
        self.editor.load(plan)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until scheduled and running reruns (and the tuner's searches) are done; False on timeout."""
        ok = self.runner.wait(timeout)
        tuner = getattr(self, "tuner", None)
        if tuner is not None:
            ok = tuner.wait(timeout) and ok
        return ok

    def show_tab(self, title: str) -> None:
        """Open the tab titled ``title`` (case ignored: ``"Fit a GPU"``, ``"GPUs"``), as a click would."""
        titles = [t.lower() for t in self.tabs.titles]
        if title.lower() not in titles:
            raise MemsaveError(f"no tab {title!r}; the explorer's tabs: {', '.join(self.tabs.titles)}")
        self.tabs.selected_index = titles.index(title.lower())

    def set_target(self, target: Target | None) -> None:
        """The target GPU every peak is judged against (header and Results table); None: no target."""
        with self._ui_lock:
            self.target = target
            self.results.set_target(target)
            self._show_target()
            self.gpus.show_target()

    def set_max_batch(self, plan: Plan, target: Target, value: int) -> None:
        """Note the max batch found for ``plan`` under ``target``: the header shows it while that
        plan and target are on display."""
        with self._ui_lock:
            self._max_batch = (plan, target, value)
            self._show_target()

    def max_batch_shown(self) -> int | None:
        """The max batch found for the plan on display under the current target, if any."""
        mb = self._max_batch
        if mb is None or self.target is None or mb[1] != self.target:
            return None
        shown = self.entry.plan if self.entry is not None else Plan()
        return mb[2] if mb[0].replace(name="") == shown.replace(name="") else None

    def _show_target(self) -> None:
        show_header_verdict(self.target_verdict, self.target, self.measurement, self.max_batch_shown())

    def run_now(self, *, raise_errors: bool = False) -> Entry | None:
        """Measure the current plan in this thread and show it; returns the Entry (None when it
        failed or was cancelled; the message is in ``explorer.error`` and in the widget)."""
        plan, gen = self.plan, self._next_generation()
        result = self.runner.run_sync(lambda ev: self._run_job(plan, ev, gen))
        if raise_errors and result is None and self.error:
            raise MemsaveError(self.error)
        return result

    def rerun(self) -> None:
        """Schedule a measurement of the current plan (what a change does when live)."""
        plan, gen = self.plan, self._next_generation()
        self._set_status("waiting", plan.describe())
        self.runner.submit(lambda ev: self._run_job(plan, ev, gen))

    def cancel(self) -> None:
        """Stop the scheduled and the running measurement; the numbers on screen stay."""
        self._user_cancelled = True
        if self.runner.cancel():
            self._set_status("cancelled", "cancel requested")

    def on_result(self, fn: Callable[[Entry], None]) -> None:
        """Call ``fn(entry)`` after each run is shown (real mode: its memory numbers first, no times)."""
        self._listeners.append(fn)

    def sweep(self, budgets: list[float] | None = None) -> None:
        """Measure the current plan compiled at each budget (on the worker; plotted as they come)."""
        from .budget_panel import DEFAULT_BUDGETS

        budgets = list(budgets if budgets is not None else DEFAULT_BUDGETS)
        plan = self.plan
        self._next_generation()
        self._set_status("waiting", f"sweep over {len(budgets)} budgets")
        self.runner.submit(lambda ev: self._sweep_job(plan, budgets, ev), delay_s=0)

    # -- edits ---------------------------------------------------------------------------------
    def _on_edit(self) -> None:
        try:
            with self._ui_lock:
                self.table.sync_controls()
                self.sac._rebuild()
                self.budget.sync_controls()
                self._sync_toolbar()
                self._show_code()
            if self._restoring:
                return
            if self.live.value:
                self.rerun()
            else:
                self._set_status("changed", "press run to measure")
        except Exception as exc:  # noqa: BLE001 - a widget callback's error would vanish: show it
            self._fail(None, exc)

    def _sync_toolbar(self) -> None:
        self._syncing = True
        try:
            irg = self.editor.input_requires_grad
            self.input_grad.value = (
                bool(irg) if irg is not None else bool(getattr(self.session.workload, "input_requires_grad", False))
            )
            self.bn_eval.value = bool(self.editor.bn_eval)
            self.preset.value = ""
        finally:
            self._syncing = False

    def _user_preset(self, change) -> None:
        if self._syncing or not change["new"]:
            return
        try:
            self.editor.load(self._presets[change["new"]])
        except Exception as exc:  # noqa: BLE001
            self._fail(self._presets[change["new"]], exc)

    def _user_input_grad(self, change) -> None:
        if self._syncing:
            return
        default = bool(getattr(self.session.workload, "input_requires_grad", False))
        self.editor.set_input_requires_grad(None if change["new"] == default else bool(change["new"]))

    def _on_select(self, module: str) -> None:
        with self._ui_lock:
            self.sac.show_module(module)

    def _unsavable_in(self, region: str) -> dict[str, str] | None:
        """Ops SAC cannot keep in ``region`` (one forward, once per explorer; real mode only)."""
        if self.session.mode != "real":
            return None
        from .sac_check import unsavable_in, unsavable_ops

        if self._unsavable is None:
            with self.session._lock if hasattr(self.session, "_lock") else threading.RLock():
                self._unsavable = unsavable_ops(self.session.workload)
        return unsavable_in(self._unsavable, region)

    def _on_pick(self, index: int) -> None:
        """A point of the history was clicked: restore that plan and show its numbers."""
        entries = self._history_entries()
        if not 0 <= index < len(entries):
            return
        entry = entries[index]
        self._restoring = True
        try:
            self.editor.load(entry.plan)
        finally:
            self._restoring = False
        self._next_generation()  # a run still going must not overwrite what was picked
        self.runner.cancel()
        self._show(entry)
        self._end("done", f"restored {entry.plan.name or entry.plan.describe()}")

    # -- display -------------------------------------------------------------------------------
    def _history_entries(self) -> list[Entry]:
        """Baseline first, then each plan tried once (its latest run): runs of the same plan from
        other cells on this session are not shown twice."""
        latest: dict[str, Entry] = {}
        base = self.session.baseline_entry
        base_key = Plan().to_json()
        for e in self.session.history:
            key = e.plan.replace(name="").to_json()
            if key == base_key:
                continue
            latest.pop(key, None)
            latest[key] = e
        return [base] + list(latest.values())

    def _current_index(self) -> int | None:
        entries = self._history_entries()
        for i in range(len(entries) - 1, -1, -1):
            if entries[i] is self.entry:
                return i
        return None

    def _show(self, entry: Entry) -> None:
        m, base = entry.measurement, self.baseline
        with self._ui_lock:
            self.entry = entry
            self.error = None
            self.title.value = self._title_for(entry.plan)
            self.error_box.value = ""
            self.error_box.layout.display = "none"
            self.saved_total.value = format_bytes(m.saved_bytes)
            self.saved_bytes.value = f"{m.saved_bytes:,} B"
            self.saved_delta.value = _delta_text(m.saved_bytes, base.saved_bytes)
            self.peak_total.value = format_bytes(m.peak_bytes)
            self.peak_bytes.value = f"{m.peak_bytes:,} B"
            self.peak_delta.value = _delta_text(m.peak_bytes, base.peak_bytes)
            self.step_time.value = (
                (
                    format_time_spread(m)
                    + (
                        f", {time_change(m, base)}"
                        if entry is not self.session.baseline_entry and m.step_seconds is not None
                        else ""
                    )
                )
                if m.step_seconds is not None
                else self._untimed_text(entry)
            )
            outputs = int(getattr(m, "output_bytes", 0) or 0)
            self.output_kept.value = f"+ {format_bytes(outputs)} outputs and caches" if outputs else ""
            self.output_kept.tooltip = (
                (
                    f"outputs and caches the step keeps to the end of forward, not saved for "
                    f"backward ({outputs:,} B); {m.saved_bytes + outputs:,} B kept in all"
                )
                if outputs
                else None
            )
            self.output_kept.layout.display = "" if outputs else "none"
            first = getattr(m, "first_step_peak_bytes", None)
            show_first = first is not None and first != m.peak_bytes
            self.first_step.value = f"(step 1: {format_bytes(first)})" if show_first else ""
            self.first_step.tooltip = (
                (f"the peak of training's steady-state step; the first step peaks at {first:,} B")
                if show_first
                else None
            )
            self.first_step.layout.display = "" if show_first else "none"
            advice = tuple(getattr(m, "advice", ()) or ())
            self.advice.value = (
                (
                    "<ul style='margin:2px 0;font-size:90%;color:#8a6d3b'>"
                    + "".join(f"<li>{html.escape(a)}</li>" for a in advice)
                    + "</ul>"
                )
                if advice
                else ""
            )
            self.advice.layout.display = "" if advice else "none"
            self.cuda_peak.value = (
                f"CUDA allocator peak {format_bytes(m.cuda_peak_bytes)}" if m.cuda_peak_bytes is not None else ""
            )
            self.cuda_peak.layout.display = "" if m.cuda_peak_bytes is not None else "none"
            show_reserved(self.reserved, m)
            self._show_target()
            self.table.show(m, base)
            self.sac.show(m, base, entry.plan)
            self.results.show(m, base)
            self.results.show_history(self._history_entries(), self._current_index())
        for fn in list(self._listeners):
            fn(entry)

    def _show_code(self) -> None:
        plan = self.plan
        if self._failed_plan is not None and plan == self._failed_plan:
            code = f"# not exported: this plan failed when it ran ({self.error or 'see the error above'})"
        else:
            try:
                code = plan.to_code(loop=self.session.workload.loop)
            except MemsaveError as exc:
                code = f"# cannot write this plan as code: {exc}"
        self.code.value = (
            "<pre style='font-size:85%;background:var(--jp-layout-color2, #f7f7f7);color:var(--jp-content-font-color1, "
            "inherit);padding:6px;white-space:pre;overflow-x:auto'>"
            f"{html.escape(code)}</pre>"
        )
        self.code_text = code
        self.plan_json.value = plan.to_json(indent=1)

    def _set_status(self, state: str, text: str = "") -> None:
        color = {
            "running": "#1f77b4",
            "waiting": "#1f77b4",
            "error": "#d62728",
            "cancelled": "#b8860b",
            "done": "#2ca02c",
            "changed": "#b8860b",
        }.get(state, "#555")
        icon = "<span class='memsave-spinner'></span>" if state in ("running", "waiting") else ""
        self.state = state
        self.status.value = (
            f"<span style='color:{color}'>{icon}<b>{html.escape(state)}</b></span> <small>{html.escape(text)}</small>"
        )


# -- the public front door -------------------------------------------------------------------------


def _check_model_device(model: nn.Module, device: str, mode: str) -> None:
    """The model must already be where the step runs: the explorer never moves a user's model."""
    import torch

    from memsave_nb.workload import check_device

    device = check_device(device)  # an unavailable device is its own one-line error
    if mode == "fake":
        return  # fake mode makes fake twins of the parameters; the device only names the batch's
    want = torch.device(device)
    for p in model.parameters():
        have = p.device
        if have.type == "meta":
            return
        if have.type != want.type or (want.index is not None and have.index != want.index):
            raise WorkloadError(
                f"the model is on {have} but device={device!r}: move it first (model.to({device!r})) "
                "or pass the device it is on"
            )
        return


def explore(
    model_or_workload: nn.Module | Workload | Session | str,
    batch: Any = None,
    loss: Callable[[Any], Any] | None = None,
    optimizer: Any = "adamw",
    device: str = "cpu",
    mode: str = "real",
    *,
    live: bool = True,
    debounce_s: float = 0.3,
    repeats: int = 3,
    tab: str | None = None,
    target_gb: float | None = None,
    **hub_kwargs: Any,
) -> Explorer:
    """Open the explorer on a model and batch, a :class:`~memsave_nb.workload.Workload`, a
    :class:`~memsave_nb.session.Session`, a demo name or a model name (``ui/by_name.py``).

    ``mode="fake"`` measures with fake tensors (sizes without memory or compute, for models too
    large to run here); ``device="cuda"`` runs on the GPU and also shows the allocator's peak.
    ``tab`` opens that tab first (``"Fit a GPU"``, ``"GPUs"``; default: ``"Layers"``).
    ``repeats``: steps timed per real-mode run (3 let a time change be judged against noise; 1 clicks faster).
    ``target_gb``: the GPU the question is about (the "Fit a GPU" target; default: the smallest preset that fits)."""
    if target_gb is not None:
        Target(target_gb)  # a bad size is one line before anything is measured
    if hub_kwargs and not isinstance(model_or_workload, str):
        raise WorkloadError(f"{', '.join(sorted(hub_kwargs))}: only with a model given by name")
    if isinstance(model_or_workload, Session):
        session = model_or_workload
    else:
        if isinstance(model_or_workload, str):
            from .by_name import workload_by_name

            if batch is not None or loss is not None:
                raise WorkloadError("a model name brings its own batch and loss; pass a model to use yours")
            workload, mode = workload_by_name(model_or_workload, device, mode, hub_kwargs)
        elif isinstance(model_or_workload, Workload):
            workload = model_or_workload
            if batch is not None or loss is not None:
                raise WorkloadError("a Workload brings its own batch and loss; pass the model to use other ones")
        elif isinstance(model_or_workload, nn.Module):
            if batch is None:
                raise WorkloadError(
                    "pass a batch: explore(model, batch) (a tensor, tuple, dict or a function making one)"
                )
            _check_model_device(model_or_workload, device, mode)
            workload = Workload(
                model_or_workload,
                batch,
                loss=loss,
                optimizer=optimizer,
                device=device,
                name=type(model_or_workload).__name__,
            )
        else:
            raise WorkloadError(
                f"explore() takes a torch.nn.Module, a Workload, a Session or a demo name, "
                f"got {type(model_or_workload).__name__}"
            )
        session = Session(workload, mode, repeats=repeats)
    explorer = Explorer(session, live=live, debounce_s=debounce_s)
    if target_gb is not None:
        explorer.tuner.set_target(target_gb)
    if tab is not None:
        explorer.show_tab(tab)
    return explorer
