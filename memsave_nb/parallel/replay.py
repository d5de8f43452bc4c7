"""A rank's reserved memory: its tracked allocations and frees replayed through the caching-allocator
model (``measure/cuda_allocator.py``), as ``measure/reserved.py`` does for one GPU, with the streams
FSDP2 allocates on kept apart.

Why per stream: torch's allocator caches a freed block in the pool of the stream it was allocated
on, and a request on another stream never takes it. FSDP2 (torch 2.13, ``_fsdp_collectives.py``)
allocates its all-gather input and output under its copy-in stream and the reduce-scatter output
(whose views become the gradient shards) under its reduce-scatter stream; the tracker notes which
(``ShardTracker.record_stream``). Not modelled: when a block is really free (a cross-stream free
waits on events the real run records; here a block is free when the tracker sees it die), NCCL's
own buffers (an unseen line), and HSDP's all-reduce stream beyond what the tracker notes.
docs/parallel.md, "Reserved memory per rank".
"""

from __future__ import annotations

from typing import Any

from ..measure.cuda_allocator import NO_LIMIT, AllocatorOOM, Block, CachingAllocator
from ..measure.reserved import ops_of, settings_of, with_workspace
from ..measure.result import ReservedMemory

Ops = tuple[tuple[int, int, int], ...]


def streams_of(
    ops: Ops, events: list[tuple[int, int]], order: list[int], record_stream: dict[int, int]
) -> tuple[int, ...]:
    """The stream of each allocator call in ``ops`` (a free's is its block's); () when all are 0.
    ``order``: the preexisting records in the order ``ops_of`` allocates them."""
    if not record_stream:
        return ()
    out, pre, of_key = [], iter(order), {}
    for key, n, event in ops:
        if n:
            rec = next(pre, None) if event < 0 else events[event][0]
            of_key[key] = record_stream.get(rec, 0) if rec is not None else 0
        out.append(of_key.get(key, 0))
    return tuple(out)


def run_streams(ops: Ops, streams: tuple[int, ...], conf: str, capacity: int = NO_LIMIT):
    """``reserved.run_ops`` with each malloc on its stream; returns the allocator and (allocated,
    reserved) after each call. Raises ``AllocatorOOM`` when ``capacity`` runs out."""
    alloc = CachingAllocator(settings_of(conf)[0], capacity=capacity)
    blocks: dict[int, Block] = {}
    series = []
    for i, (key, n, _) in enumerate(ops):
        if n:
            blocks[key] = alloc.malloc(n, streams[i] if streams else 0)
        else:
            alloc.free(blocks.pop(key))
        series.append((alloc.stats.allocated, alloc.stats.reserved))
    return alloc, series


def fits(ops: Ops, streams: tuple[int, ...], conf: str, capacity: int) -> bool:
    """The replay never runs out of ``capacity`` bytes (after torch's retries)."""
    if capacity <= 0:
        return False
    try:
        run_streams(ops, streams, conf, capacity)
    except AllocatorOOM:
        return False
    return True


def replay_rank(
    tracker: Any,
    *,
    skip: set[int] | frozenset = frozenset(),
    workspace: tuple[int, int, str] | None = None,
    conf: str | None = None,
) -> tuple[ReservedMemory, tuple[int, ...]]:
    """The rank's ``ReservedMemory`` and the stream of each of its ops. ``skip``: records not on the
    GPU (host storages under CPU offload, a real backend's staging copies), left out of the replay;
    ``workspace`` as in ``reserved.replay_tracker``. One reserved-timeline entry per tracker event
    (a skipped record's event repeats the entry before it)."""
    records, events = tracker.records, tracker.events
    kept = [k for k, (idx, _) in enumerate(events) if idx not in skip]
    sub = [events[k] for k in kept]
    pre = {i for i, rec in enumerate(records) if rec.late and rec.died is None and i not in skip}
    # ops_of reads ``records[idx].born`` against its own event index: give it the kept indices
    born = {k: j for j, k in enumerate(kept)}
    shifted = [_Born(rec, born.get(rec.born, -1)) for rec in records]
    ops = ops_of(sub, shifted, pre)
    streams = streams_of(ops, sub, sorted(i for i in pre if records[i].nbytes), tracker.record_stream)
    if workspace is not None:
        at = next((j for j, k in enumerate(kept) if k >= workspace[1]), len(kept))
        pos = next((i for i, op in enumerate(ops) if op[2] >= at), len(ops))  # where with_workspace puts it
        ops = with_workspace(ops, workspace[0], at)
        if streams:
            streams = streams[:pos] + (0,) + streams[pos:]  # the workspace: the default stream's
    settings_conf = settings_of(conf)[1]
    alloc, series = run_streams(ops, streams, settings_conf)
    timeline, last, c = [], 0, 0
    for j in range(len(sub)):
        while c < len(ops) and ops[c][2] <= j:
            last = series[c][1]
            c += 1
        timeline.append(last)
    full, j = [], -1
    for k in range(len(events)):
        if j + 1 < len(kept) and kept[j + 1] == k:
            j += 1
        full.append(timeline[j] if j >= 0 else 0)
    peak = max(range(len(series)), key=lambda i: series[i][0], default=None)
    allocated, reserved = series[peak] if peak is not None else (0, 0)
    st = alloc.stats
    # events in ops stay the kept ones' indices; the peak's is mapped back to the tracker's
    peak_event = kept[min(max(ops[peak][2], 0), len(kept) - 1)] if peak is not None and kept else 0
    return (
        ReservedMemory(
            max_reserved_bytes=st.max_reserved,
            max_allocated_bytes=st.max_allocated,
            fragmentation_bytes=reserved - allocated,
            peak_index=peak_event,
            segments=len(st.segment_allocs),
            reserved=tuple(full),
            alloc_conf=settings_conf,
            ops=ops,
            workspace_bytes=workspace[0] if workspace else 0,
            workspace_source=workspace[2] if workspace else "",
        ),
        streams,
    )


class _Born:
    """A record seen with its ``born`` event renumbered (everything else read through)."""

    def __init__(self, rec: Any, born: int) -> None:
        self._rec, self.born = rec, born

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rec, name)
