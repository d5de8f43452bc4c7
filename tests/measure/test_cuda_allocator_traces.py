"""The allocator model against two snapshots recorded on real GPUs (tests/data/gpu-traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memsave_nb.measure.cuda_trace import replay

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-traces"

# (file, segment_alloc events, segments made before the trace began, bytes reserved at the dump)
TRACES = [("eor_nn.json", 7, 3, 134_217_728), ("ftcourse.json", 152, 63, 6_471_811_072)]


@pytest.fixture(scope="module", params=TRACES, ids=[t[0] for t in TRACES])
def trace(request):
    name, n_allocs, n_old, reserved = request.param
    return json.loads((DATA / name).read_text()), n_allocs, n_old, reserved


def test_replay_with_recorded_addresses_reproduces_every_segment(trace):
    snap, n_allocs, n_old, reserved = trace
    r = replay(snap, trace_addresses=True)
    assert len(r.trace_segment_allocs) == n_allocs and r.preexisting == n_old
    assert r.model_segment_allocs == r.trace_segment_allocs  # sizes and order, to the byte
    assert r.model_segments == r.dump_segments  # every segment's size and its blocks (size, in use)
    assert r.reserved_at_dump == reserved == sum(s["total_size"] for s in snap["segments"])


def test_replay_with_made_up_addresses_reserves_the_same(trace):
    """Without the GPU's addresses only ties between equal free blocks break differently: which
    2 MiB small segment holds which small block (see docs/allocator.md), never a byte reserved."""
    snap, n_allocs, _, reserved = trace
    r = replay(snap)
    assert r.model_segment_allocs == r.trace_segment_allocs
    assert r.reserved_at_dump == reserved
    assert [s[0] for s in r.model_segments] == [s[0] for s in r.dump_segments]
    used = lambda segs: sum(size for _, blocks in segs for size, live in blocks if live)
    assert used(r.model_segments) == used(r.dump_segments)
    differ = [(m, d) for m, d in zip(r.model_segments, r.dump_segments) if m != d]
    assert all(m[0] == 2 << 20 for m, _ in differ)  # only small-pool segments differ
    assert len(differ) == (0 if n_allocs == 7 else 11)


def test_a_trace_that_ran_out_of_memory_replays_as_the_same_trace_without_its_oom_event():
    """An ``oom`` event (torch records the failed request: size, stream, free bytes; no address) is
    what a user's snapshot of a failed run holds; it made ``_start_state`` raise KeyError."""
    import copy

    snap = json.loads((DATA / "eor_nn.json").read_text())
    failed = copy.deepcopy(snap)
    events = failed["device_traces"][0]
    events.insert(len(events) // 2, {"action": "oom", "size": 2**40, "stream": 0, "device_free": 0})
    plain, with_oom = replay(snap), replay(failed)
    assert with_oom.max_reserved == plain.max_reserved and with_oom.model_segments == plain.model_segments
