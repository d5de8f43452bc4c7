"""The step's reserved memory: the tracker's ordered allocations and frees replayed through the
caching-allocator model (``cuda_allocator``), so a measurement predicts ``max_memory_reserved``
and not only ``max_memory_allocated``.

The tracker sees one stream (all its events go to stream 0) and no sizes below the dispatcher
(cuBLAS/cuDNN workspaces outside ``workspace.py``); docs/allocator.md lists what that leaves out.
"""

from __future__ import annotations

import os

from ..errors import PlanError
from .cuda_allocator import Block, CachingAllocator, Settings
from .result import ReservedMemory


def replay_tracker(events: list[tuple[int, int]], records: list, preexisting: set[int] | None = None,
                   conf: str | None = None) -> ReservedMemory:
    """Replay ``(record index, +/-bytes)`` events; ``preexisting`` records are allocated first.

    ``conf``: a ``PYTORCH_CUDA_ALLOC_CONF`` string (default: the environment's).
    """
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if conf is None else conf
    try:
        settings = Settings.parse(conf)
    except PlanError:
        settings, conf = Settings(), ""
    alloc = CachingAllocator(settings)
    blocks: dict[int, Block] = {}
    size: dict[int, int] = {}
    pre = preexisting or set()
    for i in sorted(pre):
        n = records[i].nbytes
        if n:
            blocks[i], size[i] = alloc.malloc(n), n
    timeline, best = [], (0, -1, 0)  # (reserved, allocated, event) at the allocated peak
    for k, (idx, delta) in enumerate(events):
        if idx in pre and delta > 0 and k == records[idx].born:
            pass
        elif idx not in size:
            if delta > 0:
                blocks[idx], size[idx] = alloc.malloc(delta), delta
        else:
            new = size[idx] + delta
            old = blocks.pop(idx)
            if new > 0:  # resize_: torch allocates the new storage, copies, frees the old
                blocks[idx], size[idx] = alloc.malloc(new), new
            else:
                del size[idx]
            alloc.free(old)
        st = alloc.stats
        timeline.append(st.reserved)
        if st.allocated > best[1]:
            best = (st.reserved, st.allocated, k)
    st = alloc.stats
    return ReservedMemory(
        max_reserved_bytes=st.max_reserved,
        max_allocated_bytes=st.max_allocated,
        fragmentation_bytes=best[0] - max(best[1], 0),
        peak_index=best[2],
        segments=len(st.segment_allocs),
        reserved=tuple(timeline),
        alloc_conf=conf,
    )
