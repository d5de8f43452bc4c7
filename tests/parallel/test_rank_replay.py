"""Issue 40 per rank: each rank's step replayed through the caching-allocator model (fake process
group, torch 2.13 FSDP2 and DDP), the per-rank verdict from it, and per-rank steps sized for CUDA
running the SDPA kernel CUDA would pick."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memsave_nb.measure.reserved import replay_tracker
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.parallel import step as step_mod
from memsave_nb.parallel.replay import replay_rank
from memsave_nb.parallel.verdict import rank_fit
from memsave_nb.target import RULE_80, RULE_REPLAY, Target

from .encoder_case import encoder

MIB = 1 << 20


@pytest.fixture(scope="module")
def fsdp_rank():
    """Rank 0 of the encoder (3 layers) under FSDP2 at world size 2, and the tracker its replay read."""
    seen = []
    original = step_mod.replay_rank

    def spy(tracker, **kwargs):  # records what the step hands its replay, then replays as it would
        seen.append((tracker, kwargs))
        return original(tracker, **kwargs)

    step_mod.replay_rank = spy
    try:
        m = measure_parallel(encoder(), ParallelSpec(world_size=2), ranks=[0]).rank(0)
    finally:
        step_mod.replay_rank = original
    assert len(seen) == 1
    return m, seen[0][0]


def test_fsdp2_rank_replay_is_the_single_gpu_replay_of_the_same_events(fsdp_rank):
    """With the streams left out, the per-rank replay is ``reserved.replay_tracker`` (the single-GPU
    machinery) fed the rank's events: the same ops, peak, reserved timeline and segments."""
    m, tracker = fsdp_rank
    pre = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
    single = replay_tracker(tracker.events, tracker.records, pre)
    streams, tracker.record_stream = tracker.record_stream, {}
    try:
        ours, no_streams = replay_rank(tracker)
    finally:
        tracker.record_stream = streams
    assert no_streams == () and ours == single and ours.ops == single.ops
    assert len(ours.reserved) == m.events == len(tracker.events)
    # the measured rank's replay is those same ops, each malloc on the stream FSDP2 allocated it on
    assert m.reserved.ops == single.ops and len(m.reserved_streams) == len(single.ops)


def test_fsdp2_rank_reserves_at_least_its_peak_with_its_collectives_on_their_streams(fsdp_rank):
    """Reserved >= the allocator's rounded peak >= the counted peak (12,118,708 B: four oracles, see
    CONTEXT); FSDP2's all-gather (copy-in stream) and reduce-scatter buffers sit in their own pools,
    which can only keep more cached than one pool: reserved is at least the one-stream replay's."""
    m, tracker = fsdp_rank
    r = m.reserved
    assert m.peak_bytes == 12_118_708
    assert r.max_reserved_bytes >= r.max_allocated_bytes >= m.peak_bytes
    assert set(m.reserved_streams) == {0, 1, 2}
    # what the tracker put on a side stream was born inside FSDP2's collectives
    assert set(tracker.record_stream) <= tracker.comm_records
    pre = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
    assert r.max_reserved_bytes >= replay_tracker(tracker.events, tracker.records, pre).max_reserved_bytes
    assert m.as_dict()["reserved"]["streams"] == 3


def _tracker(sizes_and_streams):
    """A tracker's plain data: each (bytes, stream) allocated in order, then the first freed."""
    records = [SimpleNamespace(nbytes=n, born=k, late=False, died=None) for k, (n, _) in enumerate(sizes_and_streams)]
    events = [(k, n) for k, (n, _) in enumerate(sizes_and_streams)] + [(0, -sizes_and_streams[0][0])]
    streams = {k: s for k, (_, s) in enumerate(sizes_and_streams) if s}
    return SimpleNamespace(records=records, events=events, record_stream=streams)


def test_a_known_sequence_gives_the_segments_the_allocator_rules_give():
    """1 MiB + 1 B rounds to 1 MiB + 512 (a multiple of 512), over 1 MiB: the large pool, and a new
    segment under 10 MiB is 20 MiB. 3 MiB more splits that segment (20 MiB - 1 MiB - 512 left). The
    first block freed, 1 MiB + 1 B again fits it on the same stream (one segment, 20 MiB); on another
    stream the cached block is not its pool's: a second 20 MiB segment. 1,000 B rounds to 1,024 in a
    2 MiB small-pool segment."""
    one = MIB + 1
    same = _tracker([(one, 0), (3 * MIB, 0)])
    same.records.append(SimpleNamespace(nbytes=one, born=3, late=False, died=None))
    same.events.append((2, one))
    r, streams = replay_rank(same)
    assert (r.segments, r.max_reserved_bytes, streams) == (1, 20 * MIB, ())
    assert r.max_allocated_bytes == (MIB + 512) + 3 * MIB
    assert r.reserved == (20 * MIB,) * 4
    other = _tracker([(one, 0), (3 * MIB, 0)])
    other.records.append(SimpleNamespace(nbytes=one, born=3, late=False, died=None))
    other.events.append((2, one))
    other.record_stream = {2: 1}
    r, streams = replay_rank(other)
    assert (r.segments, r.max_reserved_bytes) == (2, 40 * MIB) and streams == (0, 0, 0, 1)
    assert r.reserved == (20 * MIB, 20 * MIB, 20 * MIB, 40 * MIB)
    small, _ = replay_rank(_tracker([(1000, 0)]))
    assert (small.segments, small.max_reserved_bytes, small.max_allocated_bytes) == (1, 2 * MIB, 1024)


def test_host_records_are_left_out_of_the_replay():
    """A skipped record (a host storage under CPU offload) reserves nothing; the timeline keeps one
    entry per tracker event."""
    t = _tracker([(30 * MIB, 0), (1000, 0)])
    r, _ = replay_rank(t, skip={0})
    assert (r.max_reserved_bytes, r.segments) == (2 * MIB, 1) and len(r.reserved) == len(t.events) == 3
    assert r.reserved == (0, 2 * MIB, 2 * MIB)


def test_the_rank_verdict_is_reserved_plus_context_plus_buffers(fsdp_rank):
    """``rank_fit``: the replay under the GPU's capacity less 500 MiB of CUDA context and 512 MiB per
    communicator (FSDP2 over 2 ranks: one). At reserved + both it fits; a byte under the rounded
    allocations' peak + both it cannot (between, torch's out-of-memory retries free cached segments).
    The 80% rule would refuse the first size."""
    m, _ = fsdp_rank
    fixed = 500 * MIB + 512 * MIB
    need = m.reserved.max_reserved_bytes + fixed
    fit = rank_fit(Target(need / 2**30), m, communicators=1)
    assert fit.fits and fit.rule == RULE_REPLAY and fit.replay.total_bytes == need
    short = rank_fit(Target((m.reserved.max_allocated_bytes - 1 + fixed) / 2**30), m, communicators=1)
    assert not short.fits and short.replay.fix == ""  # no allocator setting makes the allocations smaller
    assert not Target(need / 2**30).fits(m.peak_bytes + fixed)  # the rule's answer at the same size
    # a rank with no replay (one rebuilt by the cross-check) is judged by the 80% rule on its device peak
    import dataclasses

    bare = dataclasses.replace(m, reserved=None)
    assert rank_fit(Target(1), bare).rule == RULE_80


@pytest.mark.parametrize(
    "gpu, dtype, backend", [("h100", torch.bfloat16, "cudnn"), ("a100", torch.float32, "memory-efficient")]
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_per_rank_step_sized_for_cuda_saves_what_the_engine_saves(gpu, dtype, backend, strategy):
    """A tiny HF Llama sized for a named GPU: each rank's SDPA runs the backend CUDA picks (cuDNN for
    bf16 on an H100, memory-efficient for fp32 on an A100), and what that adds to the rank's
    activations over its CPU-sized twin is, to the byte, what it adds to what the single-GPU engine's
    forward leaves alive (cuDNN: two int64 philox scalars per layer, 32 B; memory-efficient: 65,568 B more
    here, half of it alive but not saved by autograd). The cuBLAS workspace goes into the rank's replay as into the engine's."""
    from memsave_nb import measure
    from memsave_nb.workload import Workload

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    ids = torch.randint(0, 128, (2, 32))
    wl = Workload(model, {"input_ids": ids, "labels": ids}, name="llama", sized_for="cuda", gpu=gpu)
    cpu = wl.replace(sized_for=None, gpu=None)
    spec = ParallelSpec(world_size=2, strategy=strategy)
    ranks = [measure_parallel(w, spec, ranks=[0]).rank(0) for w in (wl, cpu)]
    single = [measure(w, mode="fake") for w in (wl, cpu)]
    assert dict(ranks[0].attention_backends).keys() == {backend} and ranks[1].attention_backends == ()
    # a rank's activations are what forward leaves alive (saved for backward and outputs kept), the
    # engine's saved and output bytes together
    kept = [m.saved_bytes + m.output_bytes for m in single]
    assert ranks[0].saved_bytes - ranks[1].saved_bytes == kept[0] - kept[1]
    assert ranks[0].saved_bytes - ranks[1].saved_bytes == (65_568 if backend == "memory-efficient" else 2 * 16)
    assert ranks[0].reserved.workspace_bytes == single[0].reserved.workspace_bytes > 0
    assert ranks[1].reserved.workspace_bytes == 0


def test_ranks_without_a_replay_keep_the_80_percent_rule_and_say_so():
    """Ranks sized with ``replay=False`` (the layout search's shallow twins; pipeline stages are
    replayed otherwise, test_pipeline_replay.py) carry no replay: the GPUs tab's verdict is the 80%
    rule on the counted peak, labelled in one line, and its line is the usable share; the unseen
    lines keep the 25% headroom."""
    pytest.importorskip("bokeh")
    from memsave_nb.parallel import measure_pipeline
    from memsave_nb.ui.parallel_view import NO_RANK_REPLAY, rank_figure, verdict_html

    from .test_pipeline import mlp, spec

    m = measure_pipeline(mlp(), spec("1f1b"), replay=False)
    assert all(r.reserved is None for r in m.ranks)
    html = verdict_html(m, Target(16))
    assert html.count("memsave-parallel-rule") == 1 and NO_RANK_REPLAY in html and "memsave-parallel-replay" not in html
    assert rank_figure(m, Target(16)).select_one({"name": "gpus_usable_line"}).location == Target(16).usable_bytes
    assert any(u.name == "allocator fragmentation and headroom" for u in m.unseen)
    assert "reserved" not in m.table().splitlines()[1]
    replayed = measure_pipeline(mlp(), spec("1f1b"))
    html = verdict_html(replayed, Target(16))
    assert "memsave-parallel-replay" in html and "memsave-parallel-rule" not in html
