"""Fake measurements run with Python's cyclic collector held off (measure/gc_pause.py): off inside
the step, back on after it (only if it was on), shared by overlapping blocks, and the numbers
equal to runs with the collector at its most eager (a collection at nearly every allocation)."""

from __future__ import annotations

import gc
import threading

import pytest

from memsave_nb import Plan, RegionPolicy, measure, zoo
from memsave_nb.measure import gc_pause
from memsave_nb.session import run_plan


def _seen_during_forward(workload, mode):
    seen = []
    handle = workload.model.register_forward_pre_hook(lambda m, a: seen.append(gc.isenabled()))
    try:
        run_plan(workload, Plan(), mode=mode, repeats=0)
    finally:
        handle.remove()
    return seen


def test_collector_off_in_a_fake_step_on_after_and_untouched_in_real_mode():
    wl = zoo.make("mlp", 4)
    assert gc.isenabled()
    assert _seen_during_forward(wl, "fake") and not any(_seen_during_forward(wl, "fake"))
    assert gc.isenabled()
    assert all(_seen_during_forward(wl, "real"))  # real steps hold real memory: garbage not kept
    gc.disable()
    try:
        measure(wl, mode="fake")
        assert not gc.isenabled()  # the user's choice is kept
    finally:
        gc.enable()


def test_overlapping_blocks_in_two_threads_turn_it_back_on_once_the_last_leaves():
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_pause.collector_paused():
            entered.set()
            release.wait(10)

    with gc_pause.collector_paused():
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread's block is still open
    release.set()
    thread.join(10)
    assert gc.isenabled()


@pytest.fixture
def eager_collector():
    """A collection every 10 allocations in every generation: any number that depends on when a
    collection frees cyclic garbage shows up against the paused runs."""
    old = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    yield
    gc.set_threshold(*old)


def test_numbers_equal_with_the_collector_at_its_most_eager(eager_collector):
    wl = zoo.make("gpt", 2)
    names = [n for n, _ in wl.model.named_modules() if n.startswith("blocks.") and n.count(".") == 1]
    plans = [Plan(), Plan(regions={names[0]: RegionPolicy()}), Plan(frozen=(names[-1],)), Plan(accumulation_steps=2)]
    paused = [run_plan(wl, p, mode="fake", repeats=0) for p in plans]
    gc_pause.ENABLED = False
    try:
        eager = [run_plan(wl, p, mode="fake", repeats=0) for p in plans]
    finally:
        gc_pause.ENABLED = True
    for plan, a, b in zip(plans, paused, eager):
        assert a == b, plan.describe()
        assert a.peak_bytes > 0
