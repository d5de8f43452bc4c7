"""A model of torch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

Why: the tracker counts live bytes (``max_memory_allocated``); an out-of-memory error is about
reserved bytes (``max_memory_reserved``), which the allocator's rounding, pools, splitting and
caching make larger. Replaying the step's ordered allocations through this model predicts them.

Rules, read in pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp`` at commit 001074d2 (torch
2.13-era; 134,496 characters). The code-index tools give no line numbers, so each rule names its
function and the character range of that file where it stands (``[a-b k]``, thousands;
``read_file`` with that offset shows it); ``docs/allocator.md`` quotes the lines.

- ``round_size`` [64-80k]: below 512 B -> 512; else a multiple of 512, or with
  ``roundup_power2_divisions`` N > 1 and size > 512*N, ``roundup_power2_next_division`` [64-80k].
- ``get_pool`` [80-96k]: size <= 1 MiB (``kSmallSize`` [0-16k]) -> small pool, else large; free
  blocks ordered by ``BlockComparatorSize`` [16-32k]: stream, size, address.
- ``get_allocation_size`` [80-96k]: a new segment is 2 MiB (small), 20 MiB (large, size < 10
  MiB) or the size rounded up to 2 MiB.
- ``get_free_block`` [80-96k]: best fit (smallest, then lowest address, same stream); in an
  expandable segment a block is sized with the unmapped space after it (``expandable_size``);
  a request below ``max_split_size`` never takes a block >= it; a request >= it takes a block
  only if under size + 20 MiB.
- ``should_split`` [80-96k]: small pool (or expandable segments): remainder >= 512 B; large
  pool: size < ``max_split_size`` and remainder > 1 MiB. Otherwise the whole block is handed out.
- ``free_block`` / ``try_merge_blocks`` [80-96k]: a freed block merges with free neighbours.
- ``malloc`` [32-48k]: no free block -> ``alloc_block`` [96-112k] (a new segment); failing that
  ``release_available_cached_blocks`` [96-112k] (only with ``max_split_size``: whole free
  oversize segments), then ``release_cached_blocks`` / ``release_blocks`` [96-112k] (every unsplit
  free segment, both pools), then out of memory. ``emptyCache`` [48-64k] is
  ``release_cached_blocks``.
- expandable segments (``find_expandable_block``, ``map_block``, ``try_allocate_expandable_block``
  [78-96k]; Note [Expandable Segments] [0-16k]): one segment per stream and pool that grows by
  2 MiB (small) or 20 MiB (large) pages. Modelled as growing at its end only; ``empty_cache``
  returns the whole pages of free blocks at the segment's end (``unmap_block`` [96-112k] also
  unmaps whole pages inside free blocks; see docs).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
NO_LIMIT = 1 << 64


class AllocatorOOM(MemoryError):
    """The model ran out of the device memory it was given (after freeing what torch frees)."""


def round_size(size: int, divisions: int = 0) -> int:
    """Bytes a request occupies (``round_size``)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size: int) -> int:
    """Bytes of a new segment for a rounded request (``get_allocation_size``)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def _growable(b: Block) -> int:
    """``expandable_size`` in ``get_free_block``: a free block at the mapped end of an expandable
    segment counts with the unmapped address space after it (modelled as unbounded)."""
    return b.size + (NO_LIMIT if b.segment.expandable and b.next is None else 0)


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    segment: Segment
    allocated: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.segment.stream, self.size, self.addr)


@dataclass(eq=False)
class Segment:
    addr: int
    size: int
    stream: int
    small: bool
    expandable: bool = False
    head: Block | None = None
    index: int = 0  # creation order; pre-existing segments count from 0 too

    def blocks(self) -> list[Block]:
        out, b = [], self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out


@dataclass
class Settings:
    """``PYTORCH_CUDA_ALLOC_CONF`` knobs the model honours."""

    max_split_size: int = NO_LIMIT
    roundup_power2_divisions: int = 0
    expandable_segments: bool = False

    @classmethod
    def parse(cls, conf: str | None) -> Settings:
        """Read ``"expandable_segments:True,max_split_size_mb:128"``; unknown keys are ignored."""
        s = cls()
        for part in (conf or "").split(","):
            key, _, val = part.partition(":")
            key, val = key.strip(), val.strip()
            try:
                if key == "max_split_size_mb":
                    s.max_split_size = int(val) << 20
                elif key == "roundup_power2_divisions" and not val.startswith("["):
                    s.roundup_power2_divisions = int(val)
                elif key == "expandable_segments":
                    s.expandable_segments = val.lower() == "true"
            except ValueError as e:
                from memsave_nb.errors import PlanError

                raise PlanError(f"PYTORCH_CUDA_ALLOC_CONF: bad value for {key[:40]!r}") from e
        return s


@dataclass
class Stats:
    allocated: int = 0
    reserved: int = 0
    max_allocated: int = 0
    max_reserved: int = 0
    segment_allocs: list[tuple[int, int, int]] = field(default_factory=list)  # (addr, size, stream)
    segment_frees: list[tuple[int, int, int]] = field(default_factory=list)
    retries: int = 0


class CachingAllocator:
    """One device's allocator state. ``capacity``: bytes the allocator may reserve in all.

    ``next_address(size)`` gives a new segment's address (default: one above the other, 2 MiB
    aligned); real addresses only matter to break ties between free blocks of one size.
    """

    def __init__(self, settings: Settings | None = None, capacity: int = NO_LIMIT, next_address=None):
        self.settings = settings or Settings()
        self.capacity = capacity
        self.stats = Stats()
        self.segments: list[Segment] = []
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._by_key: dict[tuple[int, int, int], Block] = {}
        self._top = 1 << 40
        self._made = 0
        self._next_address = next_address
        self.trace: list[dict] | None = None  # set to [] to record snapshot-style events

    def _record(self, action: str, addr: int, size: int, stream: int) -> None:
        if self.trace is not None:
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": stream, "frames": []})

    # -- free-block sets (std::set ordered by BlockComparatorSize) -------------------------------
    def _insert(self, b: Block) -> None:
        k = b.key()
        bisect.insort(self._free[b.segment.small], k)
        self._by_key[k] = b

    def _remove(self, b: Block) -> None:
        k = b.key()
        lst = self._free[b.segment.small]
        i = bisect.bisect_left(lst, k)
        assert lst[i] == k
        del lst[i]
        del self._by_key[k]

    def _best_fit(self, small: bool, stream: int, size: int) -> Block | None:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (stream, size, -1))
        if i == len(lst) or lst[i][0] != stream:
            return None
        b = self._by_key[lst[i]]
        if b.segment.expandable:  # best fit by the size a block can grow to (get_free_block)
            while i + 1 < len(lst) and lst[i + 1][0] == stream:
                nxt = self._by_key[lst[i + 1]]
                if _growable(nxt) >= _growable(b) or not b.segment.expandable:
                    break
                i, b = i + 1, nxt
        mss = self.settings.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + K_LARGE_BUFFER:
            return None
        return b

    # -- public API -------------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        s = self.settings
        size = round_size(nbytes, s.roundup_power2_divisions)
        small = size <= K_SMALL_SIZE
        block = self._best_fit(small, stream, size)
        if block is not None:
            self._remove(block)
        elif s.expandable_segments:
            block = self._grow(small, stream, size)
        else:
            alloc = allocation_size(size)
            if not self._room(alloc):
                self.stats.retries += 1
                if not (self._release_oversize(small, stream, size) and self._room(alloc)):
                    self.empty_cache()
                    if not self._room(alloc):
                        raise AllocatorOOM(f"tried to allocate {alloc} B with {self.stats.reserved} B reserved")
            block = self._new_segment(alloc, stream, small).head
        assert block is not None
        out = self._hand_out(block, size, nbytes)
        self._record("alloc", out.addr, nbytes, stream)
        return out

    def free(self, block: Block) -> None:
        assert block.allocated
        for action in ("free_requested", "free_completed"):
            self._record(action, block.addr, block.requested, block.segment.stream)
        block.allocated = False
        self.stats.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is None:
                        block.segment.head = block
                    else:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert(block)

    def empty_cache(self) -> None:
        """``release_cached_blocks``: give every whole free segment back (tail pages if expandable)."""
        for seg in list(self.segments):
            if seg.expandable:
                self._shrink(seg)
            elif seg.head is not None and seg.head.next is None and not seg.head.allocated:
                self._release(seg)

    # -- internals --------------------------------------------------------------------------------
    def _room(self, nbytes: int) -> bool:
        return self.stats.reserved + nbytes <= self.capacity

    def _hand_out(self, block: Block, size: int, nbytes: int) -> Block:
        seg = block.segment
        remaining = block.size - size
        if seg.small or self.settings.expandable_segments:
            split = remaining >= K_MIN_BLOCK
        else:
            split = size < self.settings.max_split_size and remaining > K_SMALL_SIZE
        if split:
            rest = Block(block.addr + size, remaining, seg, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated, block.requested = True, nbytes
        st = self.stats
        st.allocated += block.size
        st.max_allocated = max(st.max_allocated, st.allocated)
        return block

    def _address(self, size: int) -> int:
        if self._next_address is not None:
            addr = self._next_address(size)
            if addr is not None:
                return addr
        addr = self._top
        self._top += -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
        return addr

    def _new_segment(
        self, size: int, stream: int, small: bool, addr: int | None = None, expandable: bool = False
    ) -> Segment:
        if addr is None:  # an expandable segment reserves address space to grow into
            addr = self._address(1 << 40 if expandable else size)
        self._made += 1
        seg = Segment(addr, size, stream, small, expandable, index=self._made)
        seg.head = Block(addr, size, seg)
        self.segments.append(seg)
        st = self.stats
        st.reserved += size
        st.max_reserved = max(st.max_reserved, st.reserved)
        st.segment_allocs.append((addr, size, stream))
        if size:
            self._record("segment_alloc", addr, size, stream)
        return seg

    def _release(self, seg: Segment) -> None:
        assert seg.head is not None
        self._remove(seg.head)
        self.segments.remove(seg)
        self.stats.reserved -= seg.size
        self.stats.segment_frees.append((seg.addr, seg.size, seg.stream))
        self._record("segment_free", seg.addr, seg.size, seg.stream)

    def _release_oversize(self, small: bool, stream: int, size: int) -> bool:
        """``release_available_cached_blocks``: only with ``max_split_size`` set."""
        mss = self.settings.max_split_size
        if mss == NO_LIMIT:
            return False
        want = max(size, mss)
        lst = self._free[small]
        i = bisect.bisect_left(lst, (stream, want, -1))
        if i < len(lst) and lst[i][0] == stream:
            cands = [self._by_key[lst[i]]]
        else:
            cands, total = [], 0
            for k in reversed(lst[:i]):
                b = self._by_key[k]
                if total >= want or k[0] != stream or b.size < mss:
                    break
                cands.append(b)
                total += b.size
            ok = total >= want  # torch frees what it gathered even when that is too little
            for b in cands:
                if b.prev is None and b.next is None:
                    self._release(b.segment)
            return ok
        b = cands[0]
        if b.prev is None and b.next is None:
            self._release(b.segment)
        return True

    # expandable segments: one per (stream, pool), grown at its end by whole pages
    def _grow(self, small: bool, stream: int, size: int) -> Block:
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        seg = next((g for g in self.segments if g.expandable and g.stream == stream and g.small == small), None)
        if seg is None:
            seg = self._new_segment(0, stream, small, expandable=True)
            seg.head = None
        tail = seg.blocks()[-1] if seg.head is not None else None
        have = tail.size if tail is not None and not tail.allocated else 0
        more = -(-(size - have) // page) * page
        if not self._room(more):
            self.stats.retries += 1
            self.empty_cache()
            tail = seg.blocks()[-1] if seg.head is not None else None
            have = tail.size if tail is not None and not tail.allocated else 0
            more = -(-(size - have) // page) * page
            if not self._room(more):
                raise AllocatorOOM(f"tried to map {more} B with {self.stats.reserved} B reserved")
        st = self.stats
        st.reserved += more
        st.max_reserved = max(st.max_reserved, st.reserved)
        st.segment_allocs.append((seg.addr + seg.size, more, stream))
        self._record("segment_map", seg.addr + seg.size, more, stream)
        if have:
            assert tail is not None
            self._remove(tail)
            tail.size += more
            block = tail
        else:
            block = Block(seg.addr + seg.size, more, seg, prev=tail)
            if tail is None:
                seg.head = block
            else:
                tail.next = block
        seg.size += more
        assert block is not None
        return block

    def _shrink(self, seg: Segment) -> None:
        page = K_SMALL_BUFFER if seg.small else K_LARGE_BUFFER
        if seg.head is None:
            return
        tail = seg.blocks()[-1]
        if tail.allocated:
            return
        keep = -(-(tail.addr - seg.addr) // page) * page  # pages that hold a used byte stay mapped
        cut = max(0, seg.size - keep)
        if cut == 0:
            return
        self._remove(tail)
        tail.size -= cut
        seg.size -= cut
        self.stats.reserved -= cut
        self.stats.segment_frees.append((seg.addr + seg.size, cut, seg.stream))
        self._record("segment_unmap", seg.addr + seg.size, cut, seg.stream)
        if tail.size:
            self._insert(tail)
        elif tail.prev is None:
            seg.head = None
        else:
            tail.prev.next = None
