"""The explorer's runs on its worker thread: a plan's measurement, a compile-budget sweep, the
progress line while they run (written by ``ui/ticker.py``), and a failure shown inside the widget
(``ui/explorer.py`` mixes this in; the widgets it touches are the explorer's)."""

from __future__ import annotations

import html
import threading
import time
import traceback

from memsave_nb.errors import Cancelled, MemsaveError, StepError
from memsave_nb.measure import Measurement
from memsave_nb.plan import Plan
from memsave_nb.session import Entry

EARLY_LOCK_WAIT_S = 0.25  # how long the memory-first display waits for the UI lock before skipping


class ExplorerRuns:
    """Background runs of an :class:`~memsave_nb.ui.explorer.Explorer` (a mixin: ``self`` is the
    explorer)."""

    # -- runs ----------------------------------------------------------------------------------
    def show_first_step_peak(self, on: bool = True) -> None:
        """A switch: also measure training's first step (its peak shown as "step 1" beside the
        steady-state peak, and in the results table) at the cost of one more step per run; off
        again, runs track one step. The plan on display is run again either way."""
        if self.session.first_step_peak != bool(on):
            self.session.first_step_peak = bool(on)
            self.results.first_step.value = bool(on)  # the Results tab's switch follows (its call is then a no-op)
            self.rerun()

    def _next_generation(self) -> int:
        with self._ui_lock:
            self._generation += 1
            return self._generation

    def _run_job(self, plan: Plan, cancel_event: threading.Event, generation: int) -> Entry | None:
        if generation != self._generation:
            return None  # superseded before it started
        self._user_cancelled = False
        phase = "compiling, then measuring the step" if plan.compile_budget is not None else "measuring the step"
        self._begin(f"running: {plan.describe()}", steps=1, label=phase)
        start = time.perf_counter()
        before, early = self.entry, []
        try:
            entry = self.session.run(
                plan,
                cancel_event=cancel_event,
                on_memory=lambda e: self._show_memory_first(e, cancel_event, generation, early),
            )
        except Cancelled:
            self._timing_stopped(early, before, generation)
            if self._user_cancelled:
                self._end("cancelled", "the model is unchanged; the numbers shown are from the last run")
            return None
        except BaseException as exc:  # noqa: BLE001 - shown in the widget, not lost in a thread
            self._timing_stopped(early, before, generation)
            if generation == self._generation:
                self._fail(plan, exc, revert=True)
            return None
        if generation != self._generation:
            self._timing_stopped(early, before, generation)
            return entry  # in the history now, but a newer request owns the display
        self._show(entry)
        self._end("done", f"{plan.describe()} in {time.perf_counter() - start:.2f} s")
        return entry

    def _show_memory_first(
        self, entry: Entry, cancel_event: threading.Event, generation: int, early: list[Entry]
    ) -> None:
        """The memory numbers of a real-mode run as soon as its tracked step is done; the time
        column reads "timing..." until the timed steps finish (a newer request skips this).

        Called on the worker inside ``Session.run``, which holds the session's lock: a UI event
        may hold the UI lock while it waits for that lock (the SAC panel's one-off check), so the
        UI lock is only tried for a moment; when busy the early numbers are skipped, and the
        click shows everything at its end, as a run without them does."""
        if not self._ui_lock.acquire(timeout=EARLY_LOCK_WAIT_S):
            return
        try:
            if generation != self._generation or cancel_event.is_set():
                return
            self._timing_entry = entry
            self._show(entry, teach=False)  # inside the run: the plan is applied now
            self.ticker.label = f"memory measured in {entry.seconds:.2f} s; timing the step"
            self.ticker.tick()
            early.append(entry)
        finally:
            self._ui_lock.release()

    def _untimed_text(self, entry: Entry) -> str:
        """The time column of an entry without times: pending while its timed steps run."""
        if entry is getattr(self, "_timing_entry", None):
            return f"timing... ({self.session.repeats} steps)"
        return "-"

    def _timing_stopped(self, early: list[Entry], before: Entry | None, generation: int) -> None:
        """A run cancelled while its step was timed: its memory numbers are on screen without a
        time. Back to the last complete result, so no half-run stays on display (a newer request
        shows its own next; the runner starts it only after this job has returned)."""
        if not early:
            return
        with self._ui_lock:
            if self.entry is not early[-1]:
                return
            self._timing_entry = None
            if generation == self._generation:
                self._show(before if before is not None else self.session.baseline_entry)
            else:
                self.step_time.value = "- (timing stopped)"

    def _sweep_job(self, plan: Plan, budgets: list[float], cancel_event: threading.Event) -> None:
        self._user_cancelled = False
        self._begin(f"sweep: {len(budgets)} budgets", steps=len(budgets), label=f"budget 1 of {len(budgets)}")
        points: list[tuple[float, Measurement]] = []
        try:
            for i, b in enumerate(budgets):
                if cancel_event.is_set():
                    raise Cancelled("sweep cancelled")
                self.ticker.label = f"budget {b:g} ({i + 1} of {len(budgets)}): compiling, then measuring"
                self._set_status("running", f"sweep: budget {b:g} ({i + 1}/{len(budgets)})")
                entry = self.session.run(
                    plan.replace(compile_budget=b, name=f"{plan.name or 'compile'} @ budget {b:g}"),
                    cancel_event=cancel_event,
                )
                points.append((b, entry.measurement))
                self.sweep_points = list(points)
                with self._ui_lock:
                    self.budget.show_sweep(points)
                    self.progress.value = i + 1
                    self.results.show_history(self._history_entries(), self._current_index())
        except Cancelled:
            self._end("cancelled", f"sweep stopped after {len(points)} of {len(budgets)} budgets")
            return
        except BaseException as exc:  # noqa: BLE001
            self._fail(plan.replace(compile_budget=budgets[len(points)]), exc)
            return
        self._end("done", f"sweep over {len(budgets)} budgets")

    def _begin(self, text: str, steps: int, label: str = "") -> None:
        with self._ui_lock:
            self.progress.max = max(1, steps)
            self.progress.value = 0
            self.progress.bar_style = "info"
            self.progress.layout.visibility = "visible"
            self.cancel_button.disabled = False
            self.ticker.start(label)
            self._set_status("running", text)

    def _end(self, state: str, text: str) -> None:
        with self._ui_lock:
            self.progress.value = self.progress.max
            self.progress.layout.visibility = "hidden"
            self.cancel_button.disabled = True
            self.ticker.stop()
            self._set_status(state, text)

    def _fail(self, plan: Plan | None, exc: BaseException, *, revert: bool = False) -> None:
        if isinstance(exc, MemsaveError):
            message = str(exc)
        else:
            message = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        kind = (
            "out of memory"
            if "out of memory" in message.lower()
            else ("the step failed" if isinstance(exc, StepError) else "the run failed")
        )
        self.error = message
        undone = ""
        if plan is not None:
            self._failed_plan = plan
        if revert and plan is not None:
            good = self.entry.plan if self.entry is not None else Plan()
            # a toggle that fails must not stay on: back to the plan on display, but only while the
            # controls still show the plan that failed (an edit made since is the user's newer choice)
            with self._ui_lock:
                if good != plan and self.plan == plan:
                    self._restoring = True
                    try:
                        self.editor.load(good)
                    finally:
                        self._restoring = False
                    undone = " The change was undone: the controls show the plan of the numbers on display."
        cause = getattr(exc, "cause", None) or exc
        tb = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        with self._ui_lock:
            self.error_box.value = (
                "<div style='border:1px solid #d62728;background:#fdecea;padding:6px 8px;border-radius:3px'>"
                f"<b>{html.escape(kind.capitalize())}</b>"
                + (f" for plan <i>{html.escape(plan.describe())}</i>" if plan is not None else "")
                + f": "
                f"{html.escape(message)}<br><small>The model is as it was; the numbers shown are from the last "
                f"successful run.{undone}</small>"
                f"<details><summary><small>traceback</small></summary><pre style='font-size:80%'>{html.escape(tb)}</pre>"
                "</details></div>"
            )
            self.error_box.layout.display = ""
            self.progress.bar_style = "danger"
        self._show_code()
        self._end("error", message)
