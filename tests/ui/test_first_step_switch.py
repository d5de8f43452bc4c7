"""The explorer's first-step switch: off (the default) a run tracks one step and shows no first-step
peak; on, the plan on display runs again with training's first step too, its peak labelled
"step 1" and equal to the engine's ``measure(first_step_peak=True)``."""

from __future__ import annotations

import pytest

from memsave_nb import zoo
from memsave_nb.measure import measure
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.format import format_bytes

pytestmark = pytest.mark.timeout(300)


def test_first_step_peak_on_request():
    wl = zoo.make("gpt", 2)
    explorer = Explorer(Session(wl, "fake", repeats=0))
    explorer.run_now(raise_errors=True)
    assert explorer.measurement.first_step_peak_bytes is None
    assert explorer.first_step.layout.display == "none"

    explorer.show_first_step_peak(True)
    assert explorer.wait(120) and explorer.state == "done", explorer.error
    m = explorer.measurement
    expected = measure(wl, "fake", repeats=0, first_step_peak=True)
    assert m.first_step_peak_bytes == expected.first_step_peak_bytes is not None
    assert m.peak_bytes == expected.peak_bytes  # the steady state is the same either way
    assert expected.first_step_peak_bytes != expected.peak_bytes  # so the label is shown
    assert explorer.first_step.value == f"(step 1: {format_bytes(m.first_step_peak_bytes)})"

    explorer.show_first_step_peak(False)
    assert explorer.wait(120) and explorer.state == "done", explorer.error
    assert explorer.measurement.first_step_peak_bytes is None
    assert explorer.first_step.layout.display == "none"


def test_the_results_tab_has_the_first_step_switch():
    # the switch is a checkbox in the Results tab: ticking it runs the plan on display again with
    # the first step too, unticking it goes back to one tracked step; the Python call moves the box
    wl = zoo.make("mlp", 4)
    explorer = Explorer(Session(wl, "fake", repeats=0))
    box = explorer.results.first_step
    assert box in explorer.results.children and box.value is False
    assert explorer.tabs.children[list(explorer.tabs.children).index(explorer.results)] is explorer.results

    box.value = True
    assert explorer.session.first_step_peak is True
    assert explorer.wait(120) and explorer.state == "done", explorer.error
    expected = measure(wl, "fake", repeats=0, first_step_peak=True)
    assert explorer.measurement.first_step_peak_bytes == expected.first_step_peak_bytes is not None

    box.value = False
    assert explorer.wait(120) and explorer.state == "done", explorer.error
    assert explorer.session.first_step_peak is False and explorer.measurement.first_step_peak_bytes is None

    explorer.show_first_step_peak(True)
    assert box.value is True
    assert explorer.wait(120) and explorer.state == "done", explorer.error
    assert explorer.measurement.first_step_peak_bytes == expected.first_step_peak_bytes
