"""A collective's Work released where the rank lets it go, not later on the backend's thread.

Why (torch 2.13, ``ProcessGroupGloo.cpp``): a gloo worker thread pops a Work, runs it, marks its
future complete (which wakes ``wait()``), then does its bookkeeping, re-takes the queue lock, and only
then drops its references (``workInProgress_[i].reset()`` and its loop's local ``intrusive_ptr``). A
Work holds its tensors (inputs, outputs, their chunk views) until it is destroyed. When the rank's
thread has already let the Work go (the functional collectives' registry drops it inside
``wait_tensor``; FSDP2 drops its handle after the copy-out), the last reference is the worker's, and
the tensors are freed on that thread whenever the OS runs it: the tracker sees a buffer a few ops too
long (+12,032 B on rank 0 of TP x SP once). Seen directly (world size 1): the worker still held an
all-gather's input after ``wait_tensor`` returned in 6-9 of 100 calls, an all-to-all's in 30.

What this does: each collective is handed fresh aliases of its tensors (same storage, new
TensorImpl) and the op's own output is swapped for an alias, all watched by weak references; where
the rank lets the Work go (``wait_tensor`` returns; a ``torch.distributed`` call returns without a
handle; its handle is dropped) the rank waits, the GIL released, until those references are dead:
the Work then dies at the point fake mode's does. Only real tensors are watched; a Work something
else keeps (longer than ``GRACE_S``) ends the waiting for the rest of the step: a late free, as before.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from typing import Any, Iterator

import torch

GRACE_S = 2.0  # the longest the rank waits for a worker thread (it needs microseconds; a busy CPU, a timeslice)

# the functional collectives (TP's redistributions) that make one Work for one output
_FUNCTIONAL = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "broadcast")
# the torch.distributed calls FSDP2 and HSDP make (by module attribute: patched for the step)
_C10D_CALLS = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)


def _functional_ops() -> frozenset:
    ns = getattr(torch.ops, "_c10d_functional", None)
    ops = []
    for name in _FUNCTIONAL:
        try:
            ops.append(getattr(getattr(ns, name), "default"))
        except (AttributeError, RuntimeError):  # pragma: no cover - a torch without it
            continue
    return frozenset(ops)


def _wait_op():
    try:
        return torch.ops._c10d_functional.wait_tensor.default
    except (AttributeError, RuntimeError):  # pragma: no cover
        return None


def _is_real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.device.type != "meta"


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class WorkReleases:
    """The weak references of the collectives in flight, by output storage, and the waiting."""

    def __init__(self) -> None:
        self.pending: dict[int, list[weakref.ref]] = {}
        self.gave_up = False
        self.functional = _functional_ops()
        self.wait_op = _wait_op()

    def alias(self, value: Any, refs: list[weakref.ref]) -> Any:
        """``value`` with each real tensor (in a list or tuple too) swapped for a watched alias."""
        if _is_real(value):
            a = value.detach()
            refs.append(weakref.ref(a))
            return a
        if isinstance(value, (list, tuple)) and any(_is_real(v) for v in value):
            return type(value)(self.alias(v, refs) for v in value)
        return value

    def settle(self, refs: list[weakref.ref]) -> None:
        """Wait (GIL released) until every watched alias is gone, i.e. its Work is destroyed."""
        if self.gave_up:
            return
        deadline = None
        while any(r() is not None for r in refs):
            now = time.monotonic()
            deadline = deadline or now + GRACE_S
            if now > deadline:
                self.gave_up = True
                return
            time.sleep(0)

    # -- the functional collectives, from the dispatch watcher ------------------------------------
    def call_functional(self, func, args, kwargs):
        """Run a functional collective on aliases; the output the caller gets is an alias too."""
        refs: list[weakref.ref] = []
        args = tuple(self.alias(a, refs) for a in args)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if not _is_real(out):
            return out
        given = out.detach()
        refs.append(weakref.ref(out))
        self.pending.setdefault(_key(given), []).extend(refs)
        return given

    def waited(self, tensor: Any) -> None:
        """``wait_tensor`` returned: the registry let the Work go; wait for the worker to."""
        tensor = getattr(tensor, "elem", tensor)
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            refs = self.pending.pop(_key(tensor), None)
            if refs:
                self.settle(refs)

    # -- the torch.distributed calls --------------------------------------------------------------
    def wrap(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            from torch.utils._python_dispatch import _disable_current_modes

            refs: list[weakref.ref] = []
            with _disable_current_modes():  # the aliases are no op of the rank's (the tracker never sees them)
                args = tuple(self.alias(a, refs) for a in args)
                kwargs = {k: self.alias(v, refs) for k, v in kwargs.items()}
            work = fn(*args, **kwargs)
            if refs:
                if work is None:  # synchronous: the call waited and dropped its Work
                    self.settle(refs)
                else:  # the Work is released when the caller drops its handle
                    try:
                        weakref.finalize(work, self.settle, refs).atexit = False
                    except TypeError:  # pragma: no cover - a handle without weak references
                        pass
            return work

        return call


@contextlib.contextmanager
def released_works(releases: WorkReleases) -> Iterator[None]:
    """Patch ``torch.distributed``'s collective calls for the step (the functional ones are the
    dispatch watcher's, through ``releases``)."""
    import torch.distributed as dist

    originals = {n: getattr(dist, n) for n in _C10D_CALLS if callable(getattr(dist, n, None))}
    for n, fn in originals.items():
        setattr(dist, n, releases.wrap(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
