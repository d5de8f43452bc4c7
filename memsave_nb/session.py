"""The Session: one workload, its baseline, and the plans tried against it.

The UI, magics and CLI talk only to this object. It holds no UI code. Runs are serialised by one
lock, so a UI may call :meth:`Session.run` from a worker thread; a ``cancel_event`` stops a run
at the next module boundary (or phase boundary), and the model is restored either way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from memsave_nb.errors import Cancelled, WorkloadError, quoted
from memsave_nb.measure import Measurement, measure
from memsave_nb.measure.compiled import measure_compiled
from memsave_nb.measure.engine import model_lock
from memsave_nb.measure.gc_pause import collector_paused
from memsave_nb.plan import Plan

__all__ = ["Session", "Entry", "Delta", "BudgetPoint", "sweep_budgets", "run_plan"]

MODES = ("real", "fake")


@dataclass(frozen=True)
class Delta:
    """A measurement against the baseline: differences in bytes, ratios (plan / baseline)."""

    saved_bytes: int
    peak_bytes: int
    saved_ratio: float | None
    peak_ratio: float | None
    time_ratio: float | None

    @classmethod
    def between(cls, m: Measurement, base: Measurement) -> "Delta":
        def ratio(a: float | None, b: float | None) -> float | None:
            if a is None or b is None or b == 0:
                return None
            return a / b

        return cls(
            saved_bytes=m.saved_bytes - base.saved_bytes,
            peak_bytes=m.peak_bytes - base.peak_bytes,
            saved_ratio=ratio(m.saved_bytes, base.saved_bytes),
            peak_ratio=ratio(m.peak_bytes, base.peak_bytes),
            time_ratio=ratio(m.step_seconds, base.step_seconds),
        )


@dataclass(frozen=True)
class Entry:
    """One run: the plan, what it measured, the delta against the baseline, wall seconds."""

    plan: Plan
    measurement: Measurement
    delta: Delta
    seconds: float

    def row(self) -> dict[str, Any]:
        m, d = self.measurement, self.delta
        return {
            "plan": self.plan.name or self.plan.describe(),
            "description": self.plan.describe(),
            "saved_bytes": m.saved_bytes,
            "peak_bytes": m.peak_bytes,
            "step_seconds": m.step_seconds,
            "saved_ratio": d.saved_ratio,
            "peak_ratio": d.peak_ratio,
            "time_ratio": d.time_ratio,
            "compiled": m.compiled,
        }


def run_plan(
    workload: Any,
    plan: Plan,
    *,
    mode: str = "real",
    repeats: int = 3,
    cancel_event: threading.Event | None = None,
    measure_fn: Callable[..., Measurement] | None = None,
    first_step_peak: bool = False,
    on_memory: Callable[[Measurement], None] | None = None,
) -> Measurement:
    """Apply ``plan`` to ``workload``, measure one step, undo. Compiled plans are measured from
    the profiler's memory events (:func:`memsave_nb.measure.compiled.measure_compiled`).
    ``first_step_peak=True``: also the first training step's peak (``measure``'s, one step more).
    ``on_memory``: ``measure``'s, the memory numbers before the timed steps (not for compiled plans)."""
    if mode not in MODES:
        raise WorkloadError(f"unknown mode {quoted(mode)}; choose 'real' or 'fake'")
    _check(cancel_event)
    # the model's lock around the plan's changes too: a concurrent run on the same model (another
    # thread, another Session) waits instead of seeing (or restoring) a half-changed model
    # fake mode: the collector held off around the plan's changes too (measure/gc_pause.py)
    with (
        collector_paused() if mode == "fake" else contextlib.nullcontext(),
        model_lock(workload.model),
        plan.apply(workload) as applied,
    ):
        if plan.compiled:
            return measure_compiled(applied, mode=mode, repeats=repeats, cancel_event=cancel_event)
        handles = _cancel_hooks(applied.model, cancel_event)
        try:
            fn = measure_fn or measure
            extra: dict[str, Any] = {"first_step_peak": True} if first_step_peak else {}
            if on_memory is not None:
                extra["on_memory"] = on_memory
            return fn(applied, mode=mode, repeats=repeats, cancel_event=cancel_event, **extra)
        finally:
            for h in handles:
                h.remove()


def give_memory_back() -> None:
    """Collect cycles, then ask glibc to return its free pages (``malloc_trim``): freed Python
    objects otherwise stay in the process's resident memory. A no-op where libc is not glibc."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _check(cancel_event: threading.Event | None) -> None:
    if cancel_event is not None and cancel_event.is_set():
        raise Cancelled("run cancelled")


def _cancel_hooks(model: nn.Module, cancel_event: threading.Event | None) -> list[Any]:
    if cancel_event is None:
        return []

    def pre_hook(module: nn.Module, args: Any) -> None:
        if cancel_event.is_set():
            raise Cancelled("run cancelled")

    return [m.register_forward_pre_hook(pre_hook) for m in model.modules()]


class Session:
    """A workload, its baseline measurement (the empty plan) and the history of runs."""

    def __init__(
        self,
        workload: Any,
        mode: str = "real",
        *,
        repeats: int = 3,
        eager_baseline: bool = False,
        baseline: Measurement | None = None,
    ):
        """``baseline``: a measurement of the empty plan made elsewhere (same workload and mode),
        reused instead of measuring again."""
        if mode not in MODES:
            raise WorkloadError(f"unknown mode {quoted(mode)}; choose 'real' or 'fake'")
        self.workload = workload
        self.mode = mode
        self.repeats = repeats
        self.first_step_peak = False  # True: runs also measure the first training step's peak (one step more)
        self._lock = threading.RLock()
        self._baseline: Entry | None = None
        if baseline is not None:
            self._baseline = Entry(Plan(name="baseline"), baseline, Delta.between(baseline, baseline), 0.0)
        self._history: list[Entry] = []
        if eager_baseline:
            _ = self.baseline

    @property
    def model(self) -> nn.Module:
        return self.workload.model

    @property
    def baseline_entry(self) -> Entry:
        with self._lock:
            if self._baseline is None:
                start = time.perf_counter()
                m = run_plan(self.workload, Plan(name="baseline"), mode=self.mode, repeats=self.repeats)
                self._baseline = Entry(Plan(name="baseline"), m, Delta.between(m, m), time.perf_counter() - start)
            return self._baseline

    @property
    def baseline(self) -> Measurement:
        return self.baseline_entry.measurement

    @property
    def history(self) -> list[Entry]:
        with self._lock:
            return list(self._history)

    def run(
        self,
        plan: Plan,
        *,
        cancel_event: threading.Event | None = None,
        on_memory: Callable[[Entry], None] | None = None,
    ) -> Entry:
        """Measure ``plan`` against the baseline; append the entry to the history and return it.
        Raises :class:`~memsave_nb.errors.Cancelled` when ``cancel_event`` is set (nothing is
        recorded) and :class:`~memsave_nb.errors.StepError` when the step fails; the model is
        restored either way. ``on_memory(entry)``: real mode with timed steps, called with an
        entry of the memory numbers (no times, not recorded) before the step is timed."""
        if not isinstance(plan, Plan):
            raise TypeError(f"Session.run takes a Plan, got {type(plan).__name__}")
        plan.validate(self.model)
        with self._lock:
            _check(cancel_event)
            base = self.baseline
            start = time.perf_counter()
            early = None
            if on_memory is not None:

                def early(mem: Measurement) -> None:
                    on_memory(Entry(plan, mem, Delta.between(mem, base), time.perf_counter() - start))

            m = run_plan(
                self.workload,
                plan,
                mode=self.mode,
                repeats=self.repeats,
                cancel_event=cancel_event,
                first_step_peak=self.first_step_peak,
                on_memory=early,
            )
            entry = Entry(plan, m, Delta.between(m, base), time.perf_counter() - start)
            self._history.append(entry)
            return entry

    def run_many(self, plans: Iterable[Plan], *, cancel_event: threading.Event | None = None) -> list[Entry]:
        return [self.run(p, cancel_event=cancel_event) for p in plans]

    def compare(self, entries: Sequence[Entry] | None = None) -> list[dict[str, Any]]:
        """Rows (plain dicts): the baseline first, then each entry of the history (or ``entries``)."""
        with self._lock:
            chosen = list(self._history if entries is None else entries)
            return [self.baseline_entry.row()] + [e.row() for e in chosen]

    def clear(self) -> None:
        """Forget the history and give its memory back to the system (collected, then the C
        allocator's free pages returned), so a long notebook session does not keep it."""
        with self._lock:
            self._history.clear()
        give_memory_back()

    def sweep_budgets(
        self,
        budgets: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        plan: Plan | None = None,
        *,
        cancel_event: threading.Event | None = None,
    ) -> list["BudgetPoint"]:
        """Run ``plan`` (default: the empty plan) compiled at each budget; entries go to the history."""
        points = []
        for b in budgets:
            entry = self.run(_with_budget(plan, b), cancel_event=cancel_event)
            points.append(BudgetPoint.of(b, entry.measurement))
        return points


@dataclass(frozen=True)
class BudgetPoint:
    budget: float
    peak_bytes: int
    saved_bytes: int
    step_seconds: float | None

    @classmethod
    def of(cls, budget: float, m: Measurement) -> "BudgetPoint":
        return cls(budget, m.peak_bytes, m.saved_bytes, m.step_seconds)


def _with_budget(plan: Plan | None, budget: float) -> Plan:
    base = plan or Plan()
    return base.replace(compile_budget=budget, name=f"{base.name or 'compile'} @ budget {budget:g}")


def sweep_budgets(
    workload: Any,
    budgets: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    plan: Plan | None = None,
    *,
    repeats: int = 3,
    cancel_event: threading.Event | None = None,
) -> list[BudgetPoint]:
    """``(budget, peak_bytes, saved_bytes, step_seconds)`` for ``plan`` compiled at each budget."""
    return [
        BudgetPoint.of(b, run_plan(workload, _with_budget(plan, b), repeats=repeats, cancel_event=cancel_event))
        for b in budgets
    ]
