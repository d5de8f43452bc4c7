"""Session: baseline, runs, history, comparison rows, cancellation, worker threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from memsave_nb import presets
from memsave_nb.errors import Cancelled, MemsaveError, StepError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan, PlanError
from memsave_nb.session import Session
from plan_cases import _cnn, _gpt, _seeded


@pytest.fixture()
def session():
    return Session(_seeded(_cnn)(), repeats=1)


def test_baseline_is_lazy_and_the_empty_plan(session):
    assert session._baseline is None
    base = session.baseline
    assert base.saved_bytes > 0 and base.step_seconds is not None
    assert session.baseline is base  # computed once
    assert session.history == []


def test_run_records_entries_with_deltas(session):
    before = ModelSnapshot.capture(session.model)
    head = session.run(presets.head_only(session.model))
    ckpt = session.run(Plan(name="ckpt", regions={"blocks.0": "full", "blocks.1": "full"}))
    assert before.differences(session.model) == []
    assert [e.plan.name for e in session.history] == ["head only", "ckpt"]
    base = session.baseline
    assert head.delta.saved_bytes == head.measurement.saved_bytes - base.saved_bytes < 0
    assert head.delta.saved_ratio == pytest.approx(head.measurement.saved_bytes / base.saved_bytes)
    assert ckpt.delta.time_ratio is not None and ckpt.delta.time_ratio > 0
    rows = session.compare()
    assert [r["plan"] for r in rows] == ["baseline", "head only", "ckpt"]
    assert rows[0]["saved_ratio"] == 1.0
    assert set(rows[1]) >= {"saved_bytes", "peak_bytes", "step_seconds", "saved_ratio", "peak_ratio", "time_ratio"}


def test_a_plan_for_another_model_is_refused_by_name(session):
    with pytest.raises(PlanError, match="blocks.9"):
        session.run(Plan(regions={"blocks.9": "full"}))
    assert session.history == []


def test_cancel_before_and_during_a_run_restores_the_model(session):
    before = ModelSnapshot.capture(session.model)
    _ = session.baseline
    event = threading.Event()
    event.set()
    with pytest.raises(Cancelled):
        session.run(Plan(frozen="stem"), cancel_event=event)
    # cancelled mid-forward: the event is set when blocks.0 runs, the next module stops the step
    event = threading.Event()
    handle = session.model.blocks[0].register_forward_hook(lambda *a: event.set())
    try:
        with pytest.raises(Cancelled):
            session.run(Plan(regions={"blocks.1": "full"}), cancel_event=event)
    finally:
        handle.remove()
    assert before.differences(session.model) == []
    assert session.history == []


def test_runs_from_worker_threads_are_serialised(session):
    plans = [Plan(name=f"p{i}", regions={"blocks.0": "full"} if i % 2 else {}) for i in range(4)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        entries = list(pool.map(session.run, plans))
    assert sorted(e.plan.name for e in session.history) == ["p0", "p1", "p2", "p3"]
    assert entries[0].measurement.saved_bytes == entries[2].measurement.saved_bytes


def test_a_failing_step_raises_and_records_nothing():
    session = Session(_seeded(_cnn)(), repeats=0)
    before = ModelSnapshot.capture(session.model)
    with pytest.raises(MemsaveError, match="nothing to differentiate"):
        session.run(Plan(frozen="*"))  # nothing left to differentiate
    handle = session.model.head.register_forward_hook(lambda *a: (_ for _ in ()).throw(MemoryError("simulated")))
    try:
        with pytest.raises(StepError, match="head"):
            session.run(Plan(regions={"blocks.0": "save_matmuls"}, bn_eval=True))
    finally:
        handle.remove()
    assert session.history == []
    assert before.differences(session.model) == []


def test_fake_mode_session_runs_plans():
    session = Session(_gpt(), mode="fake")
    entry = session.run(Plan(regions={"blocks.0": "full", "blocks.1": "full"}))
    assert entry.measurement.mode == "fake" and entry.measurement.step_seconds is None
    assert entry.delta.saved_bytes < 0 and entry.delta.time_ratio is None


@pytest.mark.slow
def test_fake_mode_plans_on_a_7b_decoder():
    """A 7B-parameter decoder in fake mode: checkpointing every block keeps less, SAC in between."""
    from memsave_nb import zoo

    session = Session(zoo.make("gpt-7b"), mode="fake")
    blocks = [f"blocks.{i}" for i in range(32)]
    full = session.run(Plan(regions={b: "full" for b in blocks})).measurement
    sac = session.run(Plan(regions={b: "save_matmuls" for b in blocks})).measurement
    assert full.saved_bytes < sac.saved_bytes < session.baseline.saved_bytes
