"""Host memory held by offloaded activations: a ledger the offload hooks write and the engine reads.

It sits in ``measure/`` (not beside the hooks in ``memsave_nb.offload``) because the engine may not
import the plan's room. The hooks add each packed tensor's bytes to every ledger open on the thread
that packed it (forward runs there; backward, which releases them, may run on another thread), so a
measured step's own ledger counts only its own tensors while the process-wide :data:`LEDGER` keeps
its old meaning (everything since its last reset).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .result import HostMemory

__all__ = ["LEDGER", "OffloadLedger", "active_ledgers", "host_scope", "host_memory"]


class OffloadLedger:
    """Host bytes held by offloaded regions: live now, the most at once, moved out and back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.moved_bytes = 0  # device -> host (forward)
        self.returned_bytes = 0  # host -> device (backward)
        self.tensors = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.live_bytes += n
            self.moved_bytes += n
            self.tensors += 1
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def remove(self, n: int, *, returned: bool = False) -> None:
        """``returned``: backward copied it back (else the graph died with it unread)."""
        with self._lock:
            self.live_bytes = max(0, self.live_bytes - n)  # a reset may come between pack and release
            if returned:
                self.returned_bytes += n


LEDGER = OffloadLedger()
_local = threading.local()


def active_ledgers() -> tuple[OffloadLedger, ...]:
    """The ledgers a tensor packed now is counted in: the process-wide one and this thread's scopes."""
    return (LEDGER, *getattr(_local, "stack", ()))


@contextlib.contextmanager
def host_scope() -> Iterator[OffloadLedger]:
    """A fresh ledger for the body (this thread's packs only), closed on exit."""
    ledger = OffloadLedger()
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ledger)
    try:
        yield ledger
    finally:
        stack.remove(ledger)


def host_memory(ledger: OffloadLedger) -> HostMemory:
    """The ledger as a Measurement's plain data."""
    return HostMemory(
        peak_bytes=ledger.peak_bytes,
        to_host_bytes=ledger.moved_bytes,
        to_device_bytes=ledger.returned_bytes,
        tensors=ledger.tensors,
    )
