"""Replay a recorded allocator trace (a ``_dump_snapshot`` as plain data) through the model.

Why: the snapshot is the oracle for ``cuda_allocator``. Its trace is a ring buffer that may start
after the process did, so the start state is rebuilt backwards from the dump: segments at the
dump that no ``segment_alloc`` made existed before the first event, holding the blocks that were
live then (those freed in the trace before any alloc of theirs, and those live at the dump that
the trace never touched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memsave_nb.measure.cuda_allocator import (
    K_MIN_BLOCK,
    K_SMALL_SIZE,
    Block,
    CachingAllocator,
    Settings,
    round_size,
)


@dataclass
class Replay:
    """What the model did beside what the trace recorded."""

    model_segment_allocs: list[int]
    trace_segment_allocs: list[int]
    model_segments: list[tuple[int, tuple[tuple[int, bool], ...]]]  # (size, ((block size, allocated)...))
    dump_segments: list[tuple[int, tuple[tuple[int, bool], ...]]]
    max_reserved: int
    reserved_at_dump: int
    preexisting: int
    timeline: list[tuple[int, int]] = field(default_factory=list)  # (allocated, reserved) per event


def _start_state(events: list[dict], segments: list[dict]) -> tuple[list[dict], dict[int, int]]:
    """Segments made before the first event, and the allocations live at the first event."""
    made = {e["addr"] for e in events if e["action"] == "segment_alloc" and "addr" in e}
    old = [s for s in segments if s["address"] not in made]
    live_at_start: dict[int, int] = {}
    seen: set[int] = set()
    for e in events:
        a = e.get("addr")  # an "oom" event has none: it names the request that failed, no block
        if a is None:
            continue
        if e["action"] == "alloc":
            seen.add(a)
        elif e["action"] == "free_completed" and a not in seen:
            live_at_start[a] = e["size"]
            seen.add(a)
    for s in old:
        for b in s["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in seen:
                live_at_start[b["address"]] = b["requested_size"]
    return old, live_at_start


def _seed(alloc: CachingAllocator, seg: dict, live: dict[int, int]) -> dict[int, Block]:
    """Put one pre-existing segment into the model with the blocks live at the start."""
    small = seg["segment_type"] == "small"
    s = alloc._new_segment(seg["total_size"], seg["stream"], small, addr=seg["address"])
    alloc.stats.segment_allocs.pop()
    assert s.head is not None
    alloc._insert(s.head)
    base, end = seg["address"], seg["address"] + seg["total_size"]
    inside = sorted(a for a in live if base <= a < end)
    out = {}
    for i, a in enumerate(inside):
        size = round_size(live[a], alloc.settings.roundup_power2_divisions)
        limit = inside[i + 1] if i + 1 < len(inside) else end
        free = alloc._by_key[
            next(
                k
                for k in alloc._free[small]
                if alloc._by_key[k].segment is s
                and alloc._by_key[k].addr <= a < alloc._by_key[k].addr + alloc._by_key[k].size
            )
        ]
        if free.addr < a:  # split off the free bytes in front
            alloc._remove(free)
            front = Block(free.addr, a - free.addr, s, prev=free.prev)
            if free.prev is None:
                s.head = front
            else:
                free.prev.next = front
            free.prev, free.addr, free.size = front, a, free.size - (a - free.addr)
            front.next = free
            alloc._insert(front)
            alloc._insert(free)
        gap = limit - a - size
        if small or alloc.settings.expandable_segments:
            keep = gap < K_MIN_BLOCK
        else:
            keep = gap <= K_SMALL_SIZE
        alloc._remove(free)
        if keep:
            size = limit - a
        if size < free.size:
            rest = Block(a + size, free.size - size, s, prev=free, next=free.next)
            if free.next is not None:
                free.next.prev = rest
            free.next, free.size = rest, size
            alloc._insert(rest)
        free.allocated, free.requested = True, live[a]
        alloc.stats.allocated += free.size
        out[a] = free
    alloc.stats.max_allocated = alloc.stats.allocated
    return out


def _shape(blocks) -> tuple[tuple[int, bool], ...]:
    return tuple((size, allocated) for size, allocated in blocks)


def replay(snapshot: dict, device: int = 0, settings: Settings | None = None, trace_addresses: bool = False) -> Replay:
    """Run the trace's ``alloc``/``free_completed`` events through a fresh model.

    ``trace_addresses``: give new segments the addresses the trace's ``segment_alloc`` events
    recorded (in order), so ties between equal free blocks break as on the real GPU.
    """
    events = snapshot["device_traces"][device]
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    recorded = [e for e in events if e["action"] == "segment_alloc"]
    queue = iter([e["addr"] for e in recorded])
    alloc = CachingAllocator(settings, next_address=(lambda size: next(queue, None)) if trace_addresses else None)
    old, live = _start_state(events, segments)
    blocks: dict[int, Block] = {}
    for rec_seg in old:
        blocks.update(_seed(alloc, rec_seg, live))
    n_old = len(alloc.segments)
    alloc.stats.max_reserved = alloc.stats.reserved
    timeline = []
    for e in events:
        act = e["action"]
        if act == "alloc":
            blocks[e["addr"]] = alloc.malloc(e["size"], e["stream"])
        elif act == "free_completed":
            alloc.free(blocks.pop(e["addr"]))
        else:
            continue
        timeline.append((alloc.stats.allocated, alloc.stats.reserved))
    # the model's segments in the dump's order: old ones by address, new ones by creation order
    by_trace_addr: dict[int, Any] = {}
    new = alloc.segments[n_old:]
    order = {r["addr"]: i for i, r in enumerate(recorded)}
    made = sorted(new, key=lambda g: g.index)
    for seg, rec in zip(made, recorded):
        by_trace_addr[rec["addr"]] = seg
    for seg in alloc.segments[:n_old]:
        by_trace_addr[seg.addr] = seg
    model_segments, dump_segments = [], []
    for s in sorted(segments, key=lambda s: (s["address"] not in order, order.get(s["address"], 0), s["address"])):
        dump_segments.append(
            (s["total_size"], _shape((b["size"], b["state"] == "active_allocated") for b in s["blocks"]))
        )
        found = by_trace_addr.get(s["address"])
        if found is not None:
            model_segments.append((found.size, _shape((b.size, b.allocated) for b in found.blocks())))
    extra = [g for g in alloc.segments if g not in by_trace_addr.values()]
    for seg in extra:
        model_segments.append((seg.size, _shape((b.size, b.allocated) for b in seg.blocks())))
    return Replay(
        model_segment_allocs=[size for _, size, _ in alloc.stats.segment_allocs],
        trace_segment_allocs=[e["size"] for e in recorded],
        model_segments=model_segments,
        dump_segments=dump_segments,
        max_reserved=alloc.stats.max_reserved,
        reserved_at_dump=alloc.stats.reserved,
        preexisting=n_old,
        timeline=timeline,
    )
