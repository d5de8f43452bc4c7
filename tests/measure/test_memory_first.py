"""``measure(on_memory=...)``: the memory numbers handed over between the tracked step and the
timed steps are the returned measurement's, times aside, and come only when timed steps follow."""

from __future__ import annotations

import dataclasses

from memsave_nb import zoo
from memsave_nb.measure import measure


def test_on_memory_comes_once_before_the_times_and_equals_the_result():
    wl = zoo.make("mlp", 4)
    seen = []
    m = measure(wl, "real", repeats=2, on_memory=lambda early: seen.append(early))
    assert len(seen) == 1
    early = seen[0]
    assert early.step_seconds is None and early.step_seconds_all == ()
    assert len(m.step_seconds_all) == 2
    assert dataclasses.replace(m, step_seconds=None, step_seconds_all=()) == early


def test_no_timed_steps_no_early_numbers():
    wl = zoo.make("mlp", 4)
    seen = []
    measure(wl, "real", repeats=0, on_memory=seen.append)
    measure(wl, "fake", on_memory=seen.append)
    assert seen == []
