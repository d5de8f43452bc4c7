"""The allocator's own record of a step: an oracle that shares no blind spot with the trackers.

The CPU profiler with ``profile_memory=True`` records every allocation and free the CPU allocator
makes on the profiled thread (the autograd engine's CPU work runs there too), tensor or not:
kernel workspaces made below the dispatcher, views made by hooks, storages a Python wrapper no
longer names. Their running sum from the start of the step, plus the bytes alive before it, has a
maximum: the step's peak as the allocator saw it.

Why the raw allocation events and not ``prof._memory_profile().timeline``: the timeline sums the
same events but first builds a data-flow graph of tensor versions, which raises ("version
mismatch") on FSDP2 steps that resize storages in place; where it builds, its peak equals this
one (checked in ``test_allocator_oracle.py``).

The bytes alive before the step are the unique storages of the tensors handed in (parameters or
their local shards, buffers, gradients, optimizer state, batch, targets), counted once by address.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class AllocatorCount:
    peak_bytes: int  # baseline + the highest rise
    baseline_bytes: int  # alive before the step (what was handed in)
    rise_bytes: int  # highest running sum of allocations minus frees within the step


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors by their local shard), by address."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = _local(t).untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _walk(events: Iterable[Any]) -> Iterable[Any]:
    for e in events:
        yield e
        yield from _walk(e.children)


def allocation_events(prof: Any) -> list[tuple[int, int]]:
    """(time in ns, +bytes allocated or -bytes freed) for the CPU allocator's events, in order.

    Only frees of blocks allocated within the profiled window count: the allocator's reporter
    remembers the sizes of blocks from earlier profiling sessions, so garbage from an earlier
    measurement that the cycle collector frees during this step would otherwise be subtracted.
    """
    from torch._C._profiler import _EventType

    tree = prof.profiler.kineto_results.experimental_event_tree()
    raw = []
    for e in _walk(tree):
        if e.typed[0] == _EventType.Allocation:
            fields = e.typed[1]
            if fields.device.type == "cpu":
                raw.append((e.start_time_ns, fields.alloc_size, fields.ptr))
    raw.sort(key=lambda x: x[0])
    out, mine = [], set()
    for t, nbytes, ptr in raw:
        if nbytes > 0:
            mine.add(ptr)
        elif ptr in mine:
            mine.discard(ptr)
        else:
            continue
        out.append((t, nbytes))
    return out


def allocator_peak(step: Callable[[], None], alive_before: Iterable[Any]) -> AllocatorCount:
    """Run ``step`` under the CPU profiler and return the allocator's peak for it."""
    from torch.profiler import ProfilerActivity, profile

    baseline = storage_bytes(alive_before)
    gc.collect()  # garbage of earlier steps is not this step's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        step()
    live = rise = 0
    for _t, delta in allocation_events(prof):
        live += delta
        rise = max(rise, live)
    return AllocatorCount(baseline + rise, baseline, rise)


def timeline_peak(prof: Any) -> int:
    """The issue's recipe: ``prof._memory_profile().timeline``, PREEXISTING + CREATE - DESTROY."""
    from torch.profiler._memory_profiler import Action

    live = peak = 0
    for _t, action, _key, nbytes in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            live += nbytes
        elif action == Action.DESTROY:
            live -= nbytes
        peak = max(peak, live)
    return peak
