"""Rules of the allocator model, each checked against a number PyTorch's docs or source state."""

from __future__ import annotations

import pytest

from memsave_nb.errors import PlanError
from memsave_nb.measure.cuda_allocator import (
    AllocatorOOM,
    CachingAllocator,
    Settings,
    allocation_size,
    round_size,
)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 8000)] == [512, 512, 1024, 8192]
    # docs/notes/cuda.rst: with 4 divisions "allocation size of 1200 will be rounded to 1280" (MB)
    assert round_size(1200 * MiB, 4) == 1280 * MiB
    assert round_size(1024 * MiB, 4) == 1024 * MiB
    assert [allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB + 1)] == [
        2 * MiB,
        2 * MiB,
        20 * MiB,
        20 * MiB,
        12 * MiB,
    ]


def test_small_pool_packs_and_large_pool_splits_only_over_1mib():
    a = CachingAllocator()
    small = [a.malloc(256 * 1024) for _ in range(9)]  # nine 256 KiB: one 2 MiB segment full, one more
    assert [s for _, s, _ in a.stats.segment_allocs] == [2 * MiB, 2 * MiB]
    big = a.malloc(19 * MiB + 512)  # 20 MiB segment; 511.5 KiB left is not split off (<= 1 MiB)
    assert big.size == 20 * MiB and a.stats.allocated == 9 * 256 * 1024 + 20 * MiB
    for b in small:
        a.free(b)
    a.free(big)
    assert a.stats.reserved == 24 * MiB and a.stats.allocated == 0
    a.empty_cache()
    assert a.stats.reserved == 0


def test_best_fit_and_merging():
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(6 * MiB), a.malloc(2 * MiB)  # one 20 MiB segment
    assert len(a.segments) == 1
    a.free(y)
    w = a.malloc(5 * MiB)  # 6 MiB hole: 1 MiB left is not split off, the 8 MiB tail is bigger
    assert w.addr == y.addr and w.size == 6 * MiB
    a.free(w), a.free(x), a.free(z)
    assert [(b.size, b.allocated) for b in a.segments[0].blocks()] == [(20 * MiB, False)]


def test_streams_do_not_share_free_blocks():
    a = CachingAllocator()
    a.free(a.malloc(MiB * 4, stream=0))
    a.malloc(MiB * 4, stream=1)
    assert a.stats.reserved == 40 * MiB


def test_max_split_size_keeps_oversize_blocks_whole():
    plain, capped = CachingAllocator(), CachingAllocator(Settings.parse("max_split_size_mb:64"))
    for a in (plain, capped):
        a.free(a.malloc(200 * MiB))
        a.malloc(100 * MiB)
    assert plain.stats.reserved == 200 * MiB  # split the cached 200 MiB block
    assert capped.stats.reserved == 300 * MiB  # 200 >= 100 + 20 MiB: not taken


def test_oom_retry_frees_cached_segments_then_fails():
    a = CachingAllocator(capacity=100 * MiB)
    a.free(a.malloc(60 * MiB))
    b = a.malloc(70 * MiB)  # does not fit beside the cached 60: released, then retried
    assert a.stats.reserved == 70 * MiB and a.stats.retries == 1 and b.size == 70 * MiB
    with pytest.raises(AllocatorOOM):
        a.malloc(40 * MiB)


def test_expandable_segments_reserve_what_fragmentation_wastes():
    """Growing sizes (batch N, N+1, ...) leave slivers in fixed segments, not in one that grows."""
    sizes = [(100 + 3 * i) * MiB for i in range(6)]
    out = {}
    for conf in ("", "expandable_segments:True"):
        a = CachingAllocator(Settings.parse(conf))
        for s in sizes:
            keep, tmp = a.malloc(s // 4), a.malloc(s)
            a.free(tmp)
            a.free(keep)
        out[conf] = a.stats.max_reserved
    assert out["expandable_segments:True"] < out[""]
    assert out["expandable_segments:True"] % (20 * MiB) == 0


def test_bad_conf_is_one_line():
    with pytest.raises(PlanError, match="max_split_size_mb") as e:
        Settings.parse("max_split_size_mb:" + "x" * 500)
    assert len(str(e.value)) < 200


def test_oom_retry_with_max_split_size_frees_one_oversize_block_first():
    """``release_available_cached_blocks``: the smallest cached oversize block that covers the
    request goes back first, before any other cached segment."""
    a = CachingAllocator(Settings.parse("max_split_size_mb:64"), capacity=400 * MiB)
    big, mid = a.malloc(200 * MiB), a.malloc(160 * MiB)
    small = a.malloc(4 * MiB)  # a 20 MiB segment: 380 MiB reserved
    a.free(big), a.free(mid), a.free(small)
    a.malloc(150 * MiB)  # the cached 160 MiB block is under 150 + 20: taken whole
    assert a.stats.reserved == 380 * MiB
    a.malloc(100 * MiB)  # 200 >= 100 + 20: not taken; 380 + 100 > 400: the 200 MiB block goes back
    assert a.stats.reserved == 280 * MiB and a.stats.segment_frees == [(a.stats.segment_frees[0][0], 200 * MiB, 0)]
    assert any(s.size == 20 * MiB for s in a.segments)  # the cached small segment stayed


def test_expandable_pools_keep_apart():
    """Small and large expandable segments each grow in their own address range."""
    a = CachingAllocator(Settings.parse("expandable_segments:True"))
    x, y = a.malloc(MiB), a.malloc(4 * MiB)
    a.free(x), a.free(y)
    small, large = sorted(a.segments, key=lambda g: g.size)
    assert (small.size, large.size) == (2 * MiB, 20 * MiB) and large.addr >= small.addr + (1 << 40)
    a.empty_cache()
    assert a.stats.reserved == 0
