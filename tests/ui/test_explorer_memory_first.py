"""A real-mode click shows its memory numbers as soon as the tracked step is done and its time
when the timed steps finish ("timing..." meanwhile); a newer click or a cancel while the step is
timed never leaves one run's time on another's numbers. The timed steps are held by a gate the
test opens, so "before the timing completes" is an event, not a race against the clock."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_time_spread

pytestmark = pytest.mark.timeout(120)


class Gate(nn.Module):
    """A linear layer whose forward waits for ``release`` once ``hold`` is set: the test sets
    ``hold`` when the explorer shows the memory numbers, so only the timed steps wait."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.hold = threading.Event()
        self.release = threading.Event()

    def forward(self, x):
        if self.hold.is_set():
            assert self.release.wait(30), "the test never opened the gate"
        return torch.relu(self.lin(x))


def gated_explorer():
    torch.manual_seed(0)
    gate = Gate()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), gate)
    ex = explore(model, torch.randn(4, 8), repeats=3, debounce_s=0.01)
    memory_entries = []

    def on_result(entry):
        if entry.measurement.step_seconds is None:  # the memory numbers, before the times
            memory_entries.append(entry)
            gate.hold.set()

    ex.on_result(on_result)
    shown = []  # (plan on display, time text) each time the time text changes
    ex.step_time.observe(lambda ch: shown.append((ex.entry.plan if ex.entry else None, ch["new"])), "value")
    return ex, gate, memory_entries, shown


def wait_for(cond, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def _without_times(m):
    return dataclasses.replace(m, step_seconds=None, step_seconds_all=())


def test_memory_numbers_show_before_the_timed_steps_then_the_time():
    ex, gate, memory_entries, shown = gated_explorer()
    assert ex.session.baseline.step_seconds is not None  # the baseline was timed before the gate
    ex.table.row("0").freeze.value = True
    assert wait_for(lambda: memory_entries), ex.status.value
    # the timed steps are held: the memory numbers are on screen, the time is pending
    mem = memory_entries[0]
    assert mem.plan == Plan(frozen=("0",)) and ex.entry is mem
    assert ex.state == "running" and ex.step_time.value.startswith("timing")
    assert ex.peak_bytes.value == f"{mem.measurement.peak_bytes:,} B"
    assert ex.saved_bytes.value == f"{mem.measurement.saved_bytes:,} B"
    assert ex.results.peak_plot.source.data["total"][-1] == mem.measurement.peak_bytes
    # (Session.history would wait for the run: the session holds its lock while it measures)
    gate.release.set()
    assert ex.wait(60) and ex.state == "done", ex.status.value
    final = ex.entry
    assert final is ex.session.history[-1] and final.plan == mem.plan
    assert len(final.measurement.step_seconds_all) == 3 and final.measurement.step_seconds is not None
    assert ex.step_time.value.startswith(format_time_spread(final.measurement))
    # exact: the early numbers are the final measurement's, times aside, and the engine's
    assert _without_times(final.measurement) == mem.measurement
    gate.hold.clear()
    with Plan(frozen=("0",)).apply(ex.session.workload) as applied:
        engine = measure(applied, "real", repeats=0)
    assert mem.measurement.peak_bytes == engine.peak_bytes
    assert mem.measurement.peak_split == engine.peak_split
    assert [(r.name, r.saved_bytes) for r in mem.measurement.modules] == [
        (r.name, r.saved_bytes) for r in engine.modules
    ]
    # the time text went "timing..." then the time, on this plan's numbers only
    assert [t for p, t in shown if p == mem.plan][0].startswith("timing")


def test_a_second_click_while_timing_never_gets_the_first_clicks_time():
    ex, gate, memory_entries, shown = gated_explorer()
    first = Plan(frozen=("0",))
    ex.table.row("0").freeze.value = True
    assert wait_for(lambda: memory_entries)
    assert ex.entry.plan == first and ex.step_time.value.startswith("timing")
    ex.table.row("1").freeze.value = True  # the second click: cancels the first run's timing
    second = ex.plan
    assert second != first
    gate.release.set()  # the first run's held step goes on and meets the cancel
    assert ex.wait(60) and ex.state == "done", ex.status.value
    assert ex.entry.plan == second and ex.entry.measurement.step_seconds is not None
    assert [e.plan for e in ex.session.history] == [second]  # the first run was never timed
    # the first click's numbers never carried a time: only "timing..." or "timing stopped"
    first_texts = [t for p, t in shown if p == first]
    assert first_texts and all(t.startswith("timing") or "stopped" in t for t in first_texts), first_texts
    # the second's numbers carry the second's own time
    assert [m.plan for m in memory_entries][:2] == [first, second]
    assert ex.step_time.value.startswith(format_time_spread(ex.entry.measurement))


def test_cancel_while_timing_goes_back_to_the_last_complete_result():
    ex, gate, memory_entries, shown = gated_explorer()
    base_peak = ex.peak_bytes.value
    ex.table.row("0").freeze.value = True
    assert wait_for(lambda: memory_entries)
    ex.cancel_button.click()
    gate.release.set()
    assert ex.wait(60) and ex.state == "cancelled", ex.status.value
    assert ex.session.history == []
    assert ex.entry is ex.session.baseline_entry and ex.peak_bytes.value == base_peak
    assert not ex.step_time.value.startswith("timing")
