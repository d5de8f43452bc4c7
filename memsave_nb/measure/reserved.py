"""The step's reserved memory: the tracker's ordered allocations and frees replayed through the
caching-allocator model (``cuda_allocator``), so a measurement predicts ``max_memory_reserved``
and not only ``max_memory_allocated``.

The tracker sees one stream (all its events go to stream 0) and no sizes below the dispatcher
(cuBLAS/cuDNN workspaces outside ``workspace.py``); docs/allocator.md lists what that leaves out.
"""

from __future__ import annotations

import os

from ..errors import PlanError
from .cuda_allocator import NO_LIMIT, Block, CachingAllocator, Settings
from .result import ReservedMemory


def ops_of(
    events: list[tuple[int, int]], records: list, preexisting: set[int] | None = None
) -> tuple[tuple[int, int, int], ...]:
    """The tracker's events as allocator calls ``(key, n, event)``: n > 0 mallocs n bytes under
    key, n == 0 frees it; ``event`` is the timeline index (-1: a preexisting record, allocated
    first). A ``resize_`` is a new block, then the old one freed, as torch does it."""
    pre = preexisting or set()
    ops: list[tuple[int, int, int]] = []
    key: dict[int, int] = {}
    size: dict[int, int] = {}
    for i in sorted(pre):
        if records[i].nbytes:
            key[i], size[i] = len(ops), records[i].nbytes
            ops.append((len(ops), records[i].nbytes, -1))
    for k, (idx, delta) in enumerate(events):
        if idx in pre and delta > 0 and k == records[idx].born:
            continue
        if idx not in size:
            if delta > 0:
                key[idx], size[idx] = len(ops), delta
                ops.append((len(ops), delta, k))
            continue
        new, old = size[idx] + delta, key.pop(idx)
        if new > 0:
            key[idx], size[idx] = len(ops), new
            ops.append((len(ops), new, k))
        else:
            del size[idx]
        ops.append((old, 0, k))
    return tuple(ops)


def run_ops(ops, settings: Settings, capacity: int = NO_LIMIT) -> tuple[CachingAllocator, list[tuple[int, int]]]:
    """Replay allocator calls; returns the allocator and (allocated, reserved) after each call.
    Raises ``AllocatorOOM`` when ``capacity`` runs out even after torch's retries."""
    alloc = CachingAllocator(settings, capacity=capacity)
    blocks: dict[int, Block] = {}
    series = []
    for key, n, _ in ops:
        if n:
            blocks[key] = alloc.malloc(n)
        else:
            alloc.free(blocks.pop(key))
        series.append((alloc.stats.allocated, alloc.stats.reserved))
    return alloc, series


def settings_of(conf: str | None) -> tuple[Settings, str]:
    """Settings from ``conf`` (default: the environment's ``PYTORCH_CUDA_ALLOC_CONF``); a bad one
    reads as the defaults, so a typo in the environment never stops a measurement."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if conf is None else conf
    try:
        return Settings.parse(conf), conf
    except PlanError:
        return Settings(), ""


def with_workspace(ops: tuple[tuple[int, int, int], ...], nbytes: int, event: int) -> tuple[tuple[int, int, int], ...]:
    """``ops`` with one allocation of ``nbytes`` that is never freed (a cuBLAS workspace), made
    before the first call of timeline event ``event`` or later."""
    at = next((i for i, op in enumerate(ops) if op[2] >= event), len(ops))
    key = max((op[0] for op in ops), default=-1) + 1
    return ops[:at] + ((key, nbytes, max(event, 0)),) + ops[at:]


def replay_tracker(
    events: list[tuple[int, int]],
    records: list,
    preexisting: set[int] | None = None,
    conf: str | None = None,
    workspace: tuple[int, int, str] | None = None,
) -> ReservedMemory:
    """Replay ``(record index, +/-bytes)`` events; ``preexisting`` records are allocated first.
    ``workspace``: (bytes, event, source) of an allocation below the dispatcher kept to the end
    (``cublas_workspace``), replayed at that event. One reserved-timeline entry per event."""
    settings, conf = settings_of(conf)
    ops = ops_of(events, records, preexisting)
    if workspace is not None:
        ops = with_workspace(ops, workspace[0], workspace[1])
    alloc, series = run_ops(ops, settings)
    timeline, last, c = [], 0, 0
    for k in range(len(events)):
        while c < len(ops) and ops[c][2] <= k:
            last = series[c][1]
            c += 1
        timeline.append(last)
    peak = max(range(len(series)), key=lambda i: series[i][0], default=None)
    allocated, reserved = series[peak] if peak is not None else (0, 0)
    st = alloc.stats
    return ReservedMemory(
        max_reserved_bytes=st.max_reserved,
        max_allocated_bytes=st.max_allocated,
        fragmentation_bytes=reserved - allocated,
        peak_index=max(ops[peak][2], 0) if peak is not None else 0,
        segments=len(st.segment_allocs),
        reserved=tuple(timeline),
        alloc_conf=conf,
        ops=ops,
        workspace_bytes=workspace[0] if workspace else 0,
        workspace_source=workspace[2] if workspace else "",
    )
