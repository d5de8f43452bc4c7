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
