"""A rank's reserved memory: its tracked allocations and frees replayed through the caching-allocator
model (``measure/cuda_allocator.py``), as ``measure/reserved.py`` does for one GPU, with the streams
FSDP2 allocates on kept apart.

Why per stream: torch's allocator caches a freed block in the pool of the stream it was allocated
on, and a request on another stream never takes it. FSDP2 (torch 2.13, ``_fsdp_collectives.py``)
allocates its all-gather input and output under its copy-in stream and the reduce-scatter output
(whose views become the gradient shards) under its reduce-scatter stream; the tracker notes which
(``ShardTracker.record_stream``). Pipeline stages (``pipeline.StageRank.measure``) go through the
same path: torch 2.13's ``torch.distributed.pipelining`` selects no stream of its own (its receive
buffers, zero gradients and the tensors it sends are made on the current stream, ``stage.py`` and
``schedules._batch_p2p``); NCCL runs the sends and receives on its own stream on tensors the caller
made (its own buffers are an unseen line), so a stage's pool is the default stream's, plus
FSDP2's where the stage is sharded. Not modelled for them either: a sent tensor's block waits
for the send to finish before reuse (NCCL records it on its stream); here it is free when it dies.
Not modelled: when a block is really free (a cross-stream free
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


def per_event(ops: Ops, series: list[tuple[int, int]], n_events: int) -> list[tuple[int, int]]:
    """(allocated, reserved) after each of ``n_events`` tracker events: the state after the last op
    of that event or an earlier one (an event with no op, a skipped record's, repeats the one before)."""
    out, last, c = [], (0, 0), 0
    for k in range(n_events):
        while c < len(ops) and ops[c][2] <= k:
            last = series[c]
            c += 1
        out.append(last)
    return out


def rank_series(rank: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A replayed rank's allocated and reserved bytes after each tracker event, the allocator
    model's (``torch.cuda.memory_allocated`` / ``memory_reserved`` per event): its ops replayed again
    on their streams. ((), ()) where the rank has no replay."""
    r = getattr(rank, "reserved", None)
    if r is None or not r.ops:
        return (), ()
    _, series = run_streams(r.ops, getattr(rank, "reserved_streams", ()), r.alloc_conf)
    pairs = per_event(r.ops, series, len(r.reserved))
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


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
    # ops_of numbers the kept events; the ops carry the tracker's numbers, so a rank's ops map onto
    # its whole timeline (``rank_series``) as they do on one GPU
    ops = tuple((key, n, kept[e] if e >= 0 else e) for key, n, e in ops_of(sub, shifted, pre))
    streams = streams_of(ops, events, sorted(i for i in pre if records[i].nbytes), tracker.record_stream)
    if workspace is not None:
        pos = next((i for i, op in enumerate(ops) if op[2] >= workspace[1]), len(ops))  # where with_workspace puts it
        ops = with_workspace(ops, workspace[0], workspace[1])
        if streams:
            streams = streams[:pos] + (0,) + streams[pos:]  # the workspace: the default stream's
    settings_conf = settings_of(conf)[1]
    alloc, series = run_streams(ops, streams, settings_conf)
    full = [r for _, r in per_event(ops, series, len(events))]
    peak = max(range(len(series)), key=lambda i: series[i][0], default=None)
    allocated, reserved = series[peak] if peak is not None else (0, 0)
    st = alloc.stats
    peak_event = max(ops[peak][2], 0) if peak is not None else 0
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
