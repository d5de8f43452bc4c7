"""Elapsed seconds beside a running job: while it runs, a small daemon thread rewrites one
progress line twice a second ("<what runs> · 12 s elapsed"). The explorer's runs and the "Fit a
GPU" panel's searches each hold one."""

from __future__ import annotations

import html
import threading
import time
from typing import Any


class Ticker:
    """Writes ``text.value`` (an ``ipywidgets.HTML``) while started; ``lock`` is the UI lock held
    while it writes. ``label`` may change while it runs (a sweep's budget i of n)."""

    def __init__(self, lock: Any, text: Any, name: str):
        self.lock = lock
        self.text = text
        self.name = name
        self.label = ""
        self.started: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        """Start counting from now (call with the lock held: the line is written at once)."""
        self.label = label
        self.started = time.perf_counter()
        self.tick()
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def tick(self) -> None:
        """Write the line now: what runs and for how long."""
        started = self.started
        if started is None:
            return
        elapsed = time.perf_counter() - started
        self.text.value = (
            f"<small>{html.escape(self.label)}{' · ' if self.label else ''}{elapsed:.0f} s elapsed</small>"
        )

    def stop(self) -> None:
        """Stop counting and clear the line (the thread ends at its next wake-up)."""
        self.started = None
        self.text.value = ""

    def _loop(self) -> None:
        while self.started is not None:
            time.sleep(0.5)
            with self.lock:
                self.tick()
