"""Debounced background runs: the newest request wins, one worker thread at a time.

A widget change calls :meth:`Runner.submit`; the job runs on a worker thread, so the kernel
stays responsive. A request while the runner is idle starts at once (``leading=True``); requests that come while
one is scheduled or running form a burst: the running job is cancelled and only the last
request starts, ``debounce_s`` after the burst ends. A new request while a job runs cancels that job
(its ``threading.Event`` is set) and starts once it has stopped. :meth:`wait` blocks until
nothing is scheduled or running; :meth:`run_sync` runs a job in the calling thread.

Jobs are callables ``job(cancel_event)``; they report their own results and errors (the runner
only keeps the worker alive: an exception that escapes a job is stored in ``last_exception``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

Job = Callable[[threading.Event], Any]


class Runner:
    def __init__(self, debounce_s: float = 0.3, *, leading: bool = True, name: str = "memsave-run"):
        self.debounce_s = debounce_s
        self.leading = leading
        self.name = name
        self.last_exception: BaseException | None = None
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._pending: Job | None = None
        self._thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None
        self._idle = threading.Event()
        self._idle.set()

    # -- state ------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A job is scheduled or running."""
        return not self._idle.is_set()

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None

    # -- requests ---------------------------------------------------------------------------
    def submit(self, job: Job, *, delay_s: float | None = None) -> None:
        """Schedule ``job`` after the debounce delay; it replaces any job not yet started and
        cancels the one running."""
        delay = self.debounce_s if delay_s is None else delay_s
        with self._lock:
            idle = self._thread is None and self._timer is None and self._pending is None
            if self.leading and idle:
                delay = 0
            self._pending = job
            self._idle.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._cancel is not None:
                self._cancel.set()  # stale: a newer request supersedes the running job
            if delay <= 0:
                self._start_locked()
            else:
                self._timer = threading.Timer(delay, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def cancel(self) -> bool:
        """Drop the scheduled job and stop the running one. True when there was something to stop."""
        with self._lock:
            had = self._pending is not None or self._thread is not None or self._timer is not None
            self._pending = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._cancel is not None:
                self._cancel.set()
            if self._thread is None:
                self._idle.set()
            return had

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is scheduled or running; False on timeout."""
        return self._idle.wait(timeout)

    def run_sync(self, job: Job) -> Any:
        """Run ``job`` in the calling thread after dropping the scheduled job and letting the
        running one finish (it is cancelled)."""
        self.cancel()
        self.wait()
        event = threading.Event()
        with self._lock:
            self._cancel = event
            self._idle.clear()
        try:
            return job(event)
        finally:
            with self._lock:
                if self._cancel is event:
                    self._cancel = None
                if self._thread is None and self._pending is None and self._timer is None:
                    self._idle.set()

    # -- worker -----------------------------------------------------------------------------
    def _fire(self) -> None:
        with self._lock:
            self._timer = None
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is not None:
            return  # picked up when the running job ends
        job, self._pending = self._pending, None
        if job is None:
            if self._timer is None:
                self._idle.set()
            return
        event = threading.Event()
        self._cancel = event
        self._thread = threading.Thread(target=self._work, args=(job, event), name=self.name, daemon=True)
        self._thread.start()

    def _work(self, job: Job, event: threading.Event) -> None:
        try:
            job(event)
        except BaseException as exc:  # noqa: BLE001 - a job reports its own errors; keep the worker sane
            self.last_exception = exc
        finally:
            with self._lock:
                self._thread = None
                if self._cancel is event:
                    self._cancel = None
                if self._pending is not None and self._timer is None:
                    self._start_locked()
                elif self._pending is None and self._timer is None:
                    self._idle.set()
