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
``.memsave-host`` (host memory and bytes moved per step, shown when the plan offloads a region),
``.memsave-teach-rule`` / ``.memsave-teach-phases`` (the "Rule of thumb" tab's tables, rows named by
``data-part``), ``.memsave-target-verdict`` (fits / does not fit the "Fit a GPU" tab's target, with the class
``memsave-fits`` or ``memsave-nofit``, and the max batch once found for the plan on display), and
per module ``.memsave-freeze-<slug>`` (see :mod:`memsave_nb.ui.layer_table`).

A run that fails leaves the numbers of the last good run on screen, puts the controls back to that
run's plan (a failing toggle does not stay on) and never shows the failed plan as code.
"""

from __future__ import annotations

import html
import threading
import weakref
from typing import Any, Callable, NamedTuple

import ipywidgets as W
from torch import nn

from memsave_nb.checkpointing import RegionKind
from memsave_nb.errors import MemsaveError
from memsave_nb.measure import Measurement
from memsave_nb.measure.common import sized_words
from memsave_nb.measure.rule_of_thumb import TeacherView
from memsave_nb.plan import Plan
from memsave_nb.session import Entry, Session
from memsave_nb.target import Target
from memsave_nb.workload import Workload

from .budget_panel import BudgetPanel
from .editor import PlanEditor
from .explorer_header import Header
from .explorer_open import _check_model_device, session_for  # noqa: F401 - _check_model_device: public here too
from .explorer_runs import ExplorerRuns
from .explorer_status import StatusBar, status_html
from .explorer_tabs import CodeTab, Toolbar
from .explorer_teach import TeachTab, view_for
from .explorer_text import _delta_text, loss_note_html, output_kind, title_html  # noqa: F401 - public here too
from .format import format_time_spread, time_change
from .layer_table import LayerTable, tied_by_module
from .plots import bokehjs_loader
from .results_panel import ResultsPanel
from .runner import Runner
from .sac_panel import SacPanel
from .sized import batch_words
from .styles import explorer_style, narrow_tables_style, teach_style
from .ticker import Ticker
from .verdict import show_header_verdict

__all__ = ["Explorer", "explore", "last_explorer"]

_last_explorer: "weakref.ref[Explorer] | None" = None


def last_explorer() -> "Explorer | None":
    """The explorer made last in this process (``%memsave_report`` reports its session)."""
    return _last_explorer() if _last_explorer is not None else None


TAB_TITLES = ("Layers", "SAC per op", "Compile budget", "Results", "Plan as code", "GPUs", "Rule of thumb")
TEACH_CACHE = 256  # teacher's views kept (one per entry shown): a pick in the history shows its own again


class _MaxBatch(NamedTuple):
    """The max batch the "Fit a GPU" tab found, for which plan and target."""

    plan: Plan
    target: Target
    value: int


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
        self.target: Target | None = None  # fits / does not fit the target GPU (set in the "Fit a GPU" tab)
        self._max_batch: _MaxBatch | None = None
        self._unsavable: list | None = None
        self._failed_plan: Plan | None = None  # the plan whose last run failed: never exported
        self.code_text = ""
        self._views: dict[int, tuple[Entry, TeacherView | str]] = {}  # id(entry): the entry and its view
        self._build_header(live)
        self._build_tabs(base_entry, max_open_rows)
        super().__init__(
            [
                bokehjs_loader(),
                explorer_style(),
                narrow_tables_style(),
                teach_style(),
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
        self._wire()
        self._show(base_entry)
        self._show_code()
        from .tuner_panel import TunerPanel

        self.tuner = TunerPanel(self)
        self.tabs.children = (*self.tabs.children, self.tuner)
        self.tabs.set_title(len(self.tabs.children) - 1, TunerPanel.TITLE)
        self._set_status("idle", "baseline measured")
        global _last_explorer
        _last_explorer = weakref.ref(self)

    # -- construction ----------------------------------------------------------------------------
    def _build_header(self, live: bool) -> None:
        """The header (ui/explorer_header.py) and the status bar (ui/explorer_status.py); each widget
        is kept under its own name too (tests, notebooks and the DOM hooks above read them)."""
        h = self.header = Header.build(self._title_for(None), loss_note_html(self.session.workload, self.session.mode))
        self.title, self.summary, self.advice, self.loss_note = h.title, h.summary, h.advice, h.loss_note
        self.saved_total, self.saved_bytes, self.saved_delta = h.saved_total, h.saved_bytes, h.saved_delta
        self.peak_total, self.peak_bytes, self.peak_delta = h.peak_total, h.peak_bytes, h.peak_delta
        self.output_kept, self.first_step, self.reserved = h.output_kept, h.first_step, h.reserved
        self.step_time, self.cuda_peak, self.target_verdict = h.step_time, h.cuda_peak, h.target_verdict
        self.host = h.host
        b = self.bar = StatusBar.build(live)
        self.run_button, self.cancel_button, self.live = b.run_button, b.cancel_button, b.live
        self.progress, self.progress_text, self.status = b.progress, b.progress_text, b.status
        self.status_bar, self.error_box = b.box, b.error_box
        self.ticker = Ticker(self._ui_lock, self.progress_text, "memsave-progress")

    def _build_tabs(self, base_entry: Entry, max_open_rows: int) -> None:
        """The tabs and their panels; the "Fit a GPU" tab is added last, once the explorer is wired."""
        from .parallel_panel import ParallelPanel

        session = self.session
        t = self.toolbar = Toolbar.build(session.workload)
        self._presets = t.presets
        self.preset, self.input_grad, self.bn_eval, self.reset_button = (
            t.preset,
            t.input_grad,
            t.bn_eval,
            t.reset_button,
        )
        self.table = LayerTable(
            self.editor, max_open_rows=max_open_rows, on_select=self._on_select, tied=tied_by_module(self.model)
        )
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
        self.code_tab = CodeTab.build()
        self.code, self.plan_json = self.code_tab.code, self.code_tab.plan_json
        # per-rank sizing, on demand; judged against the "Fit a GPU" target
        self.gpus = ParallelPanel(session.workload, plan_fn=lambda: self.plan, target_fn=lambda: self.target)
        self.teach = TeachTab.build()  # the rule of thumb beside the measured split (ui/explorer_teach.py)
        children = [t.layers_tab(self.table), self.sac, self.budget, self.results, self.code_tab.tab, self.gpus]
        self.tabs = W.Tab(children=[*children, self.teach.tab])
        self.tuner = None  # the "Fit a GPU" panel (ui/tuner_panel.py), added once the wiring is done
        for i, title in enumerate(TAB_TITLES):
            self.tabs.set_title(i, title)

    def _wire(self) -> None:
        self.editor.on_change(self._on_edit)
        self.run_button.on_click(lambda _b: self.rerun())
        self.cancel_button.on_click(lambda _b: self.cancel())
        self.live.observe(lambda ch: self.rerun() if ch["new"] and self.state == "changed" else None, "value")
        self.preset.observe(self._user_preset, "value")
        self.input_grad.observe(self._user_input_grad, "value")
        self.bn_eval.observe(lambda ch: None if self._syncing else self.editor.set_bn_eval(ch["new"]), "value")
        self.reset_button.on_click(lambda _b: self.set_plan(Plan()))

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
            self._max_batch = _MaxBatch(plan, target, value)
            self._show_target()

    def max_batch_shown(self) -> int | None:
        """The max batch found for the plan on display under the current target, if any."""
        mb = self._max_batch
        if mb is None or self.target is None or mb.target != self.target:
            return None
        shown = self.entry.plan if self.entry is not None else Plan()
        return mb.value if mb.plan.replace(name="") == shown.replace(name="") else None

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

    def _view_of(self, entry: Entry) -> TeacherView | str:
        """The teacher's view of ``entry`` (counted once per entry), or why there is none. Never
        called inside a run: it applies the plan itself."""
        got = self._views.get(id(entry))
        if got is not None and got[0] is entry:
            return got[1]
        try:
            view: TeacherView | str = view_for(self.session.workload, entry.plan, entry.measurement)
        except Exception as exc:  # noqa: BLE001 - the teacher's view is extra: the run's numbers still show
            view = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if len(self._views) >= TEACH_CACHE:
            self._views.pop(next(iter(self._views)))
        self._views[id(entry)] = (entry, view)
        return view

    def _show(self, entry: Entry, *, teach: bool = True) -> None:
        """Show ``entry`` everywhere; ``teach=False``: a run's early numbers, shown from inside the
        run (the plan is applied then), leave the "Rule of thumb" tab to the run's end."""
        m, base = entry.measurement, self.baseline
        view = self._view_of(entry) if teach else None
        offloads = any(p.kind is RegionKind.OFFLOAD for p in entry.plan.active_regions.values())
        with self._ui_lock:
            self.entry = entry
            self.error = None
            self.title.value = self._title_for(entry.plan)
            self.error_box.value = ""
            self.error_box.layout.display = "none"
            self.header.show(m, base, self._step_text(entry), offloads=offloads)
            self._show_target()
            self.table.show(m, base)
            self.sac.show(m, base, entry.plan)
            self.results.show(m, base)
            self.results.show_history(self._history_entries(), self._current_index())
            if isinstance(view, TeacherView):
                self.teach.show(view)
            elif view is not None:
                self.teach.show_error(view)
        for fn in list(self._listeners):
            fn(entry)

    def _step_text(self, entry: Entry) -> str:
        """The step-time line: the spread of the timed steps and the change against the baseline."""
        m = entry.measurement
        if m.step_seconds is None:
            return self._untimed_text(entry)
        if entry is self.session.baseline_entry:
            return format_time_spread(m)
        return f"{format_time_spread(m)}, {time_change(m, self.baseline)}"

    def _show_code(self) -> None:
        plan = self.plan
        if self._failed_plan is not None and plan == self._failed_plan:
            code = f"# not exported: this plan failed when it ran ({self.error or 'see the error above'})"
        else:
            try:
                code = plan.to_code(loop=self.session.workload.loop)
            except MemsaveError as exc:
                code = f"# cannot write this plan as code: {exc}"
        self.code_tab.show(code, plan.to_json(indent=1))
        self.code_text = code

    def _set_status(self, state: str, text: str = "") -> None:
        self.state = state
        self.status.value = status_html(state, text)


# -- the public front door -------------------------------------------------------------------------


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
    session = session_for(
        model_or_workload, batch, loss, optimizer, device, mode, repeats=repeats, hub_kwargs=hub_kwargs
    )
    explorer = Explorer(session, live=live, debounce_s=debounce_s)
    if target_gb is not None:
        explorer.tuner.set_target(target_gb)
    if tab is not None:
        explorer.show_tab(tab)
    return explorer
