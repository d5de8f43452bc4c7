"""Python's cyclic garbage collector held off while a fake measurement runs.

Why: a fake step makes and drops some 100,000 Python objects (fake tensors, autograd nodes, the
tracker's records). With the collector on, the ones alive at a collection are promoted, and every
second or third measurement that pushes the oldest generation over its threshold, which walks
every object of the process: with torch, transformers and peft imported about 490,000, 0.25 s of
CPU on this machine, half of an edit's 0.45 s on Qwen2.5-0.5B + LoRA (issue 42). Held off, the
step's objects die by reference count as before and are never promoted; what is left (cyclic
garbage) is collected after the block as usual. The CLI's one-shot process does ``gc.freeze()``
instead (cli/workload.py); a library inside a notebook must not freeze the user's objects.

Fake mode only: a fake step holds no real memory, so garbage kept to the end of the block costs
nothing. Nested and concurrent blocks (threads) share one count: the collector is turned back on
by the last block out, and only if it was on before the first.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_LOCK = threading.Lock()
_DEPTH = 0
_WAS_ENABLED = False
ENABLED = True  # False: measurements run with the collector as the user left it (bench/edit_speed.py's "before")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off the cyclic collector for the block (see the module doc)."""
    global _DEPTH, _WAS_ENABLED
    if not ENABLED:
        yield
        return
    with _LOCK:
        if _DEPTH == 0:
            _WAS_ENABLED = gc.isenabled()
            gc.disable()
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _WAS_ENABLED:
                gc.enable()
