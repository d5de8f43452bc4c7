"""The "Fit a GPU" panel built on a small host instead of the explorer (``ui/tuner_host.py``):
the target reaches the host, the knob controls become the host's plan, the verdict is for the
host's measurement (a real fake-mode measurement)."""

from __future__ import annotations

import threading

import pytest

from memsave_nb import zoo
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.target import Target
from memsave_nb.ui.tuner_panel import TunerPanel

TINY_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


class _Editor:
    def __init__(self) -> None:
        self.callbacks = []

    def on_change(self, fn) -> None:
        self.callbacks.append(fn)


class _Session:
    def __init__(self, workload) -> None:
        self.workload = workload


class Host:
    """Everything TunerHost asks for, and nothing of the explorer."""

    def __init__(self, workload) -> None:
        self.session = _Session(workload)
        self.editor = _Editor()
        self._ui_lock = threading.RLock()
        self.target: Target | None = None
        self._plan = Plan()
        self._measurement = measure(workload, mode="fake", repeats=0)
        self.results = []
        self.plans: list[Plan] = []

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def measurement(self):
        return self._measurement

    def set_plan(self, plan: Plan) -> None:
        self.plans.append(plan)
        self._plan = plan

    def set_target(self, target: Target | None) -> None:
        self.target = target

    def set_max_batch(self, plan: Plan, target: Target, value: int | None) -> None:
        pass

    def max_batch_shown(self) -> int | None:
        return None

    def on_result(self, callback) -> None:
        self.results.append(callback)


@pytest.mark.timeout(120)
def test_panel_runs_on_a_host_that_is_not_the_explorer():
    host = Host(zoo.gpt(TINY_GPT, batch_size=4))
    panel = TunerPanel(host)
    assert len(host.results) == 1 and len(host.editor.callbacks) == 1  # wired through the interface only
    peak = host.measurement.peak_bytes
    panel.target_menu.value = 0.0
    panel.target_gb.value = peak * 0.9 / 0.8 / 2**30  # under peak / headroom: does not fit
    assert "does not fit" in panel.verdict.value
    assert host.target == Target(panel.target_gb.value)
    panel.knob_batch.value = 2
    panel.knob_precision.value = "bf16"
    panel.apply_knobs()
    assert host.plans and host.plan.batch_size == 2 and host.plan.precision == "bf16"
