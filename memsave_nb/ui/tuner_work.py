"""The "Fit a GPU" panel's background work: one job at a time on a worker thread (the newest
request wins, a generation marks stale results), the status line, the elapsed-seconds ticker and
the cancel button (the ticker is ``ui/ticker.py``'s). ``ui/tuner_panel.py`` hands it each search's
work and its "done" text."""

from __future__ import annotations

import html
import threading
import time
from typing import Any, Callable

import ipywidgets as W

from memsave_nb.errors import Cancelled, MemsaveError

from .pareto_figure import FITS_COLOR, MISS_COLOR
from .runner import Runner
from .ticker import Ticker


def one_line(exc: BaseException) -> str:
    """An error as the one line the panel shows (our errors' message, else type and first line)."""
    if isinstance(exc, MemsaveError):
        return " ".join(str(exc).split())
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


class TunerWork:
    """The panel's worker, status line and cancel button; ``lock`` is the explorer's UI lock, held
    while shared widgets are written."""

    def __init__(self, lock: Any):
        self.lock = lock
        self.runner = Runner(0.0, name="memsave-tuner")
        self.generation = 0
        self.user_cancelled = False
        self.state = "idle"
        self.error: str | None = None
        self.requested: float | None = None  # when the user asked (the click), not when the worker started
        self.cancel_button = W.Button(description="cancel", icon="stop", disabled=True, layout=W.Layout(width="100px"))
        self.cancel_button.add_class("memsave-tuner-cancel")
        self.status = W.HTML("")
        self.status.add_class("memsave-tuner-status")
        self.progress_text = W.HTML("")
        self.progress_text.add_class("memsave-tuner-progress")
        self.ticker = Ticker(lock, self.progress_text, "memsave-tuner-progress")
        self.cancel_button.on_click(lambda _b: self.cancel())

    def set_status(self, state: str, text: str = "") -> None:
        color = {"error": MISS_COLOR, "cancelled": "#b8860b", "done": FITS_COLOR}.get(state, "#1f77b4")
        self.state = state
        self.error = text if state == "error" else None
        self.status.value = (
            f"<span style='color:{color}'><b>{html.escape(state)}</b></span> "
            f"<small style='color:{color if state == 'error' else 'inherit'}'>{html.escape(text)}</small>"
        )

    def submit(
        self, label: str, work: Callable[[threading.Event], Any], done: Callable[[Any], str], background: bool
    ) -> Any:
        """Run ``work(cancel_event)``, then show ``done(value)`` as the status; on the worker when
        ``background`` (returns None), else in this thread (returns the value, None if it failed)."""
        with self.lock:
            self.generation += 1
            generation = self.generation
            self.requested = time.perf_counter()
        job = lambda ev: self._job(label, work, done, ev, generation)  # noqa: E731
        if background:
            self.set_status("waiting", label)
            self.runner.submit(job, delay_s=0)
            return None
        return self.runner.run_sync(job)

    def waited(self, fallback: float) -> float:
        """Seconds since the user asked (the click): the search and, when none fits, the knobs tried
        after it (the planner's own ``seconds`` left those out: 31 s shown for an 87 s wait)."""
        return time.perf_counter() - self.requested if self.requested is not None else fallback

    def _job(
        self,
        label: str,
        work: Callable[[threading.Event], Any],
        done: Callable[[Any], str],
        cancel_event: threading.Event,
        generation: int,
    ) -> Any:
        if generation != self.generation:
            return None  # superseded before it started
        self.user_cancelled = False
        self._begin(label)
        try:
            value = work(cancel_event)
        except Cancelled:
            if generation == self.generation or self.user_cancelled:
                self._end("cancelled", f"{label}: stopped; the model is as it was")
            return None
        except BaseException as exc:  # noqa: BLE001 - shown in the panel, never lost in a thread
            if generation == self.generation:
                self._end("error", f"{label}: {one_line(exc)}")
            return None
        if generation != self.generation:
            return None  # a newer request owns the display
        with self.lock:
            text = done(value)
        self._end("done", text)
        return value

    def cancel(self) -> bool:
        """Stop the running search / max batch at its next measurement (the model is restored)."""
        self.user_cancelled = True
        stopped = self.runner.cancel()
        if stopped:
            self.set_status("cancelled", "cancel requested")
        return stopped

    def _begin(self, label: str) -> None:
        with self.lock:
            self.cancel_button.disabled = False
            self.ticker.start(label)
            self.set_status("running", label)

    def _end(self, state: str, text: str) -> None:
        with self.lock:
            self.ticker.stop()
            self.cancel_button.disabled = True
            self.set_status(state, text)
