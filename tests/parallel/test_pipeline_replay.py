"""Issue 40 for pipeline stages: each stage rank's tracked step (torch 2.13's schedules on a fake
process group) replayed through the caching-allocator model, as FSDP2 / DDP ranks are
(``parallel/replay.py``), and the per-rank verdict from it."""

from __future__ import annotations

import pytest

from memsave_nb.measure.reserved import replay_tracker
from memsave_nb.parallel import ParallelSpec, measure_pipeline
from memsave_nb.parallel import pipeline as pipeline_mod
from memsave_nb.parallel.replay import rank_series, replay_rank
from memsave_nb.parallel.verdict import rank_fit, worst_fit
from memsave_nb.target import RULE_REPLAY, Target

from .test_pipeline import MICRO, mlp, spec, tiny_gpt

MIB = 1 << 20


def _spied(workload, sp):
    """``measure_pipeline`` with every tracker handed to the replay kept (and replayed as it would be)."""
    seen = []
    original = pipeline_mod.replay_rank

    def spy(tracker, **kwargs):
        seen.append((tracker, kwargs))
        return original(tracker, **kwargs)

    pipeline_mod.replay_rank = spy
    try:
        m = measure_pipeline(workload, sp)
    finally:
        pipeline_mod.replay_rank = original
    assert len(seen) == len(m.ranks)
    return m, [t for t, _ in seen]


@pytest.fixture(scope="module")
def pp2():
    return _spied(mlp(), spec("1f1b"))


def test_pp2_ranks_are_replayed_as_one_gpu_replays_the_same_events(pp2):
    """Every 1F1B stage rank carries a replay; pipelining allocates on the current stream only, so
    the replay is ``reserved.replay_tracker`` (the single-GPU machinery) fed the rank's events, op for
    op; reserved >= the rounded peak >= the counted peak. Every block is at most 1 MiB (a 64 x 512
    float32 weight or micro-batch activation is 128 KiB), so all come from the small pool's 2 MiB
    segments: two per stage, 4 MiB reserved over a rounded peak of about 3.1 MB."""
    m, trackers = pp2
    assert [r.peak_bytes for r in m.ranks] == [3_246_368, 2_967_876]
    for r, tracker in zip(m.ranks, trackers):
        pre = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
        single = replay_tracker(tracker.events, tracker.records, pre)
        assert r.reserved == single and r.reserved.ops == single.ops and r.reserved_streams == ()
        assert len(r.reserved.reserved) == r.events == len(tracker.events)
        assert r.reserved.max_reserved_bytes >= r.reserved.max_allocated_bytes >= r.peak_bytes
    assert [r.reserved.max_allocated_bytes for r in m.ranks] == [3_252_736, 2_978_816]
    assert [(r.reserved.max_reserved_bytes, r.reserved.segments) for r in m.ranks] == [(4 * MIB, 2)] * 2
    assert m.as_dict()["ranks"][0]["reserved"]["streams"] == 1


def test_pp2_verdict_is_the_replay_and_the_rule_is_gone(pp2):
    """``worst_fit`` on a pipeline layout: the replay decides (reserved + 500 MiB context + 512 MiB
    per communicator); at exactly that size the deciding rank fits, a byte under its rounded peak
    + the fixed lines it does not."""
    m, _ = pp2
    n = m.spec.communicators
    rank, fit = worst_fit(Target(80), m)
    assert fit.rule == RULE_REPLAY and fit.fits and fit.replay.communicators == n
    fixed = 500 * MIB + 512 * MIB * n
    need = rank.reserved.max_reserved_bytes + fixed
    assert rank_fit(Target(need / 2**30), rank, communicators=n).fits
    short = (rank.reserved.max_allocated_bytes - 1 + fixed) / 2**30
    assert not rank_fit(Target(short), rank, communicators=n).fits


def test_rank_series_is_the_replays_own_timeline(pp2):
    """The GPUs tab's per-rank lines: the reserved series equals ``RankMeasurement.reserved``'s
    timeline, the allocated series peaks at ``max_allocated_bytes`` and never exceeds reserved."""
    m, _ = pp2
    for r in m.ranks:
        allocated, reserved = rank_series(r)
        assert reserved == r.reserved.reserved and len(allocated) == r.events
        assert max(allocated) == r.reserved.max_allocated_bytes and max(reserved) == r.reserved.max_reserved_bytes
        assert all(a <= b for a, b in zip(allocated, reserved))


def test_pp2_x_fsdp2_stage_ranks_keep_fsdp2s_streams():
    """PP 2 x FSDP2 2: each stage's FSDP2 allocates on its all-gather and reduce-scatter streams
    inside the schedule's step; the replay keeps those pools apart (streams 0, 1, 2), so it reserves
    at least what a one-stream replay of the same events reserves."""
    sp = ParallelSpec(world_size=4, pipeline_parallel=2, schedule="1f1b", microbatches=MICRO)
    m, trackers = _spied(tiny_gpt(), sp)
    assert [r.ranks for r in m.ranks] == [(0, 1), (2, 3)]
    for r, tracker in zip(m.ranks, trackers):
        assert set(r.reserved_streams) == {0, 1, 2}
        assert set(tracker.record_stream) <= tracker.comm_records
        assert r.reserved.max_reserved_bytes >= r.reserved.max_allocated_bytes >= r.peak_bytes
        streams, tracker.record_stream = tracker.record_stream, {}
        try:
            one, _ = replay_rank(tracker)
        finally:
            tracker.record_stream = streams
        assert r.reserved.ops == one.ops and r.reserved.max_reserved_bytes >= one.max_reserved_bytes
        assert rank_series(r)[1] == r.reserved.reserved


def test_replay_false_leaves_the_stages_to_the_rule():
    """The layout search's shallow twins are measured with ``replay=False``: no replay, the 80% rule."""
    m = measure_pipeline(mlp(), spec("gpipe"), replay=False)
    assert all(r.reserved is None for r in m.ranks)
    assert worst_fit(Target(16), m)[1].replay is None


def test_the_per_rank_report_of_a_pipeline_layout_shows_reserved_per_stage(capsys):
    """``memsave-nb report --pp 2 --target-gb 1``: the table has a predicted-reserved column (each
    stage's replay) and the verdict is the deciding stage's replay, no 80% rule."""
    import torch

    from memsave_nb import zoo
    from memsave_nb.cli import main

    argv = ["report", "--model", "mlp", "--batch", "16", "--pp", "2", "--world-size", "2", "--schedule", "1f1b"]
    assert main([*argv, "--target-gb", "1"]) == 0
    out = capsys.readouterr().out
    wl = zoo.make("mlp", 16)
    m = measure_pipeline(
        wl,
        ParallelSpec(world_size=2, pipeline_parallel=2, schedule="1f1b", microbatches=4),
        loss_fn=torch.nn.functional.cross_entropy,
        target=wl.loss.targets,
    )
    rank, fit = worst_fit(Target(1), m)
    assert m.table() in out and "reserved" in m.table().splitlines()[1]
    assert f"deciding rank {rank.rank}" in out and fit.verdict(Target(1)) in out and "no allocator replay" not in out


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_every_schedules_stage_ranks_are_replayed_on_the_default_stream(schedule):
    """GPipe and interleaved 1F1B (two stages per rank) too: the single-GPU replay of each rank's events."""
    m, trackers = _spied(mlp(), spec(schedule))
    for r, tracker in zip(m.ranks, trackers):
        pre = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
        assert r.reserved == replay_tracker(tracker.events, tracker.records, pre) and r.reserved_streams == ()
        assert r.reserved.max_reserved_bytes >= r.reserved.max_allocated_bytes >= r.peak_bytes
