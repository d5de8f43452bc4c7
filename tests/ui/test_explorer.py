"""The explorer driven as a user would, without a browser: set widget values, click buttons,
wait for the rerun, and compare what is on display with the engine's Measurement for that plan
(measured here directly with Plan.apply + measure)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from memsave_nb import zoo
from memsave_nb.checkpointing import policy_preset
from memsave_nb.errors import WorkloadError
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui import figures
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.explorer import Explorer, explore
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPTConfig

pytestmark = pytest.mark.timeout(300)

TINY_GPT = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def cnn_workload() -> Workload:
    return zoo.make("cnn", 4)


def gpt_workload() -> Workload:
    return zoo.gpt(TINY_GPT, batch_size=2)


def engine(workload: Workload, plan: Plan, mode: str = "real"):
    """The engine's own numbers for ``plan``: no UI, no Session."""
    with plan.apply(workload) as applied:
        return measure(applied, mode, repeats=0)


def assert_shows(ex: Explorer, m) -> None:
    """What the explorer displays is the Session's Measurement, exactly, and that Measurement is
    the engine's ``m`` for the same plan."""
    shown = ex.measurement
    # the engine's numbers for the plan
    assert shown.saved_bytes == m.saved_bytes
    assert [(r.name, r.saved_bytes) for r in shown.modules] == [(r.name, r.saved_bytes) for r in m.modules]
    assert shown.peak_split.activations == m.peak_split.activations
    # the first step in a process may keep a small lazily made tensor alive (a few KiB of
    # temporaries); the peak is otherwise the engine's
    assert shown.peak_bytes == pytest.approx(m.peak_bytes, rel=2e-3)
    # on screen: labels, table rows, figure sources
    assert ex.saved_bytes.value == f"{m.saved_bytes:,} B"
    assert ex.saved_total.value == format_bytes(m.saved_bytes)
    assert ex.peak_bytes.value == f"{shown.peak_bytes:,} B"
    assert ex.peak_total.value == format_bytes(shown.peak_bytes)
    for name in ex.table.rows:
        assert ex.table.displayed_saved_bytes(name) == m.module(name).saved_bytes, name
    base = ex.baseline
    data = ex.results.layers_plot.source.data
    expected = figures.layer_bars_data(m, base, top=figures.DEFAULT_TOP)
    assert data["saved_bytes"] == expected["saved_bytes"] and data["name"] == expected["name"]
    assert sum(data["saved_bytes"]) == figures.kept_total(m)  # every byte in a bar: the header's total
    assert sum(data["backward_bytes"]) == m.saved_bytes
    assert ex.results.timeline_plot.source.data["total"] == figures.timeline_data(shown)["total"]
    assert ex.results.peak_plot.source.data["total"] == [base.peak_bytes, shown.peak_bytes]
    for c in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"):
        assert ex.results.peak_plot.source.data[c][-1] == getattr(shown.peak_split, c)


@pytest.fixture()
def cnn():
    wl = cnn_workload()
    return Explorer(Session(wl, repeats=1), debounce_s=0.05)


@pytest.fixture()
def gpt():
    wl = gpt_workload()
    return Explorer(Session(wl, repeats=1), debounce_s=0.05)


# -- the baseline on display --------------------------------------------------------------------
def test_the_baseline_is_shown_with_dom_hooks(cnn):
    assert cnn.state == "idle" and cnn.error is None
    assert_shows(cnn, cnn.session.baseline)
    assert "memsave-explorer" in cnn._dom_classes
    assert "memsave-saved-total" in cnn.saved_total._dom_classes
    row = cnn.table.row("layers.0")
    assert {"memsave-freeze", "memsave-freeze-layers-0"} <= set(row.freeze._dom_classes)
    assert "memsave-freeze-root" in cnn.table.row("").freeze._dom_classes
    assert "memsave-region-layers-0" in row.region._dom_classes
    assert cnn.plan.is_empty
    assert cnn.code_text == Plan().to_code()
    # a parameter-free leaf has no freeze box to click
    assert cnn.table.row("stem.2").freeze.layout.visibility == "hidden"


# -- freezing -------------------------------------------------------------------------------------
def test_freezing_a_block_reruns_and_shows_the_engines_numbers(cnn):
    wl = cnn.session.workload
    before = ModelSnapshot.capture(wl.model)
    box = cnn.table.row("stem").freeze
    box.value = True  # the user ticks "freeze" on the stem
    # a parent toggles its children
    assert all(cnn.table.row(n).freeze.value for n in ("stem.0", "stem.1"))
    assert cnn.wait(120)
    assert cnn.state == "done", cnn.status.value
    assert cnn.plan == Plan(frozen=("stem",))
    expected = engine(wl, Plan(frozen=("stem",)))
    assert expected.saved_bytes < cnn.baseline.saved_bytes  # the stem keeps nothing now
    assert_shows(cnn, expected)
    assert cnn.saved_delta.value.startswith("(-")
    assert "stem" in cnn.code_text and cnn.code_text == cnn.plan.to_code()
    assert before.differences(wl.model) == []  # the UI never leaves the model changed
    # unticking one child unticks the parent, the plan lists what stays frozen
    cnn.table.row("stem.1").freeze.value = False
    assert not box.value
    assert cnn.wait(120)
    assert cnn.plan.frozen == ("stem.0",)
    assert_shows(cnn, engine(wl, Plan(frozen=("stem.0",))))


def test_memory_saving_switch_and_bn_eval(cnn):
    wl = cnn.session.workload
    cnn.table.row("").freeze.value = True
    cnn.input_grad.value = True
    cnn.bn_eval.value = True
    cnn.table.row("").memsave.value = True
    assert cnn.wait(120) and cnn.state == "done", cnn.status.value
    plan = cnn.plan
    assert plan.frozen == ("",) and plan.memsave == ("*",) and plan.input_requires_grad is True
    assert plan.bn_eval == ("*",)
    expected = engine(wl, plan)
    assert_shows(cnn, expected)
    assert expected.saved_bytes < 0.5 * cnn.baseline.saved_bytes  # the paper's "input only, BN eval" case


def test_the_title_and_the_code_name_the_loop():
    ex = Explorer(Session(cnn_workload().replace(loop="keep_output_step"), repeats=0), debounce_s=0.05)
    assert "loop keep_output_step" in ex.title.value
    assert "loop &#x27;keep_output_step&#x27;" in ex.code.value or "loop 'keep_output_step'" in ex.code.value


def test_a_failed_run_undoes_only_its_own_change_never_later_edits(cnn):
    """The race behind a flaky ``test_memory_saving_switch_and_bn_eval``: freezing everything
    (no input grad: nothing to differentiate) runs and fails; the user's next click lands in the
    editor before the explorer has reacted to it (a new run not yet requested); the failed run's
    revert then put back the plan on display and wiped that click. Made deterministic here: the
    failing run waits until the click is in the editor, and the click's handling waits until the
    failed run is over."""
    real_run = cnn.session.run
    failing, click_landed, worker = threading.Event(), threading.Event(), {}

    def slow_run(plan, **kwargs):  # the engine, slowed on purpose: the failing step waits for the click
        if plan.frozen and not plan.input_requires_grad:
            worker["thread"] = threading.current_thread()
            failing.set()
            assert click_landed.wait(30)
        return real_run(plan, **kwargs)

    def in_the_window():  # runs first on every edit, before the explorer reacts to it
        if not failing.is_set() or click_landed.is_set() or threading.current_thread() is worker["thread"]:
            return
        click_landed.set()
        assert cnn.runner.wait(30)  # the failed run, its revert included, is over

    cnn.session.run = slow_run
    cnn.editor._listeners.insert(0, in_the_window)
    cnn.table.row("").freeze.value = True  # this run fails
    assert failing.wait(30)
    cnn.input_grad.value = True  # the click made while it runs
    assert click_landed.is_set()
    assert cnn.wait(120) and cnn.state == "done", cnn.status.value
    assert cnn.plan.frozen == ("",) and cnn.plan.input_requires_grad is True
    assert cnn.entry.plan == cnn.plan  # and the numbers on display are that plan's


def test_a_plan_preset_sets_every_control(cnn):
    from memsave_nb.presets import presets_for

    wl = cnn.session.workload
    cnn.preset.value = "input only, BN eval"
    assert cnn.wait(120) and cnn.state == "done", cnn.status.value
    expected_plan = presets_for(wl.model)["input only, BN eval"]
    assert cnn.entry.plan.name == "input only, BN eval"
    assert set(cnn.plan.trainable_parameter_names(wl.model)) == set(expected_plan.trainable_parameter_names(wl.model))
    assert cnn.plan.input_requires_grad is True and cnn.plan.bn_eval == expected_plan.bn_eval
    assert cnn.input_grad.value and cnn.bn_eval.value and cnn.table.row("").freeze.value
    assert cnn.preset.value == ""  # the menu is an action, not a state
    assert_shows(cnn, engine(wl, expected_plan))


# -- selective checkpointing ---------------------------------------------------------------------
def test_switching_a_region_to_save_matmuls(gpt):
    wl = gpt.session.workload
    gpt.table.row("blocks.0").region.value = "save_matmuls"
    assert gpt.sac.module == "blocks.0"  # choosing a region shows its ops
    assert gpt.wait(120) and gpt.state == "done", gpt.status.value
    plan = Plan(regions={"blocks.0": "save_matmuls"})
    assert gpt.plan == plan
    expected = engine(wl, plan)
    assert expected.saved_bytes < gpt.baseline.saved_bytes
    assert_shows(gpt, expected)
    assert gpt.results.history_plot.source.data["peak_bytes"][-1] == expected.peak_bytes
    # the SAC panel: one row per op type of the region, toggles following the policy
    ops = [o.op for o in gpt.baseline.ops_in("blocks.0")]
    assert gpt.sac.op_names() == ops and "aten.addmm" in ops
    assert gpt.sac.toggle("aten.addmm").value == "save"
    assert gpt.sac.toggle("aten.gelu").value == "recompute"
    assert gpt.sac.presets.value == "save_matmuls"


def test_toggling_one_op_in_the_sac_panel(gpt):
    wl = gpt.session.workload
    gpt.table.select("blocks.1")
    assert gpt.sac.toggle("aten.gelu").value == "save"  # not a region: eager keeps everything
    gpt.sac.toggle("aten.gelu").value = "recompute"
    assert gpt.wait(120) and gpt.state == "done", gpt.status.value
    policy = gpt.plan.regions["blocks.1"]
    assert policy.recomputed_ops == {"aten.gelu"} and policy.default.value == "save"
    assert gpt.table.row("blocks.1").region.value == "custom"
    assert_shows(gpt, engine(wl, gpt.plan))
    # presets from the panel
    gpt.sac.presets.value = "full"
    assert gpt.wait(120)
    assert gpt.plan.regions == {"blocks.1": policy_preset("full")}
    assert gpt.sac.toggle("aten.gelu").value == "recompute"
    assert_shows(gpt, engine(wl, gpt.plan))


# -- history ------------------------------------------------------------------------------------
def test_clicking_a_history_point_restores_that_plan(cnn):
    cnn.table.row("stem").freeze.value = True
    assert cnn.wait(120)
    first = cnn.entry
    cnn.table.row("layers.2").region.value = "full"
    assert cnn.wait(120)
    assert len(cnn.session.history) == 2, [e.plan.describe() for e in cnn.session.history]
    history = cnn.results.history_plot.source.data
    assert history["peak_bytes"] == [cnn.baseline.peak_bytes] + [e.measurement.peak_bytes for e in cnn.session.history]
    cnn.results.history_plot.source.selected.indices = [1]  # what a tap does
    assert cnn.plan == first.plan
    assert not cnn.busy  # restoring shows the stored numbers, no rerun
    assert cnn.entry is first
    assert_shows(cnn, first.measurement)
    assert cnn.table.row("stem").freeze.value and cnn.table.row("layers.2").region.value == "none"
    cnn.results.history_plot.source.selected.indices = [0]  # the baseline
    assert cnn.plan.is_empty and not cnn.table.row("stem").freeze.value


# -- live reruns: debounce, static mode, cancel, errors -------------------------------------------
def test_quick_changes_are_debounced_into_one_run():
    ex = Explorer(Session(cnn_workload(), repeats=0), debounce_s=0.5)
    for name in ("stem", "layers.0", "layers.1"):
        ex.table.row(name).freeze.value = True
    assert ex.busy and ex.state in ("waiting", "running")
    assert ex.wait(120)
    assert [e.plan for e in ex.session.history] == [ex.plan]
    assert ex.plan.frozen == ("stem", "layers.0", "layers.1")


def test_static_mode_measures_on_request():
    wl = cnn_workload()
    ex = Explorer(Session(wl, repeats=0), live=False)
    ex.table.row("stem").freeze.value = True
    assert not ex.busy and ex.state == "changed" and ex.session.history == []
    entry = ex.run_now()
    assert entry is not None and entry.plan == Plan(frozen=("stem",))
    assert_shows(ex, engine(wl, ex.plan))
    ex.run_button.click()  # the "run" button schedules the same
    assert ex.wait(120) and len(ex.session.history) == 2
    ex.table.row("layers.0").freeze.value = True
    assert ex.state == "changed"
    ex.live.value = True  # turning live reruns on measures what changed meanwhile
    assert ex.wait(120) and ex.session.history[-1].plan == ex.plan and ex.state == "done"


class Slow(nn.Module):
    """A layer that takes its time, so a run can be cancelled halfway."""

    def __init__(self, width: int = 8, seconds: float = 0.15):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return torch.relu(self.lin(x))


def test_cancel_stops_the_run_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(*[Slow() for _ in range(6)])
    ex = explore(model, torch.randn(4, 8), repeats=0, debounce_s=0.01)
    shown = ex.saved_bytes.value
    before = ModelSnapshot.capture(model)
    ex.table.row("0").freeze.value = True
    deadline = time.monotonic() + 30
    while ex.state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ex.state == "running" and not ex.cancel_button.disabled
    ex.cancel_button.click()
    assert ex.wait(60)
    assert ex.state == "cancelled", ex.status.value
    assert ex.session.history == [] and ex.saved_bytes.value == shown
    assert ex.error is None and ex.cancel_button.disabled
    assert before.differences(model) == []


def test_a_run_overtaken_by_a_history_click_does_not_overwrite_it():
    torch.manual_seed(0)
    model = nn.Sequential(*[Slow(seconds=0.1) for _ in range(4)])
    ex = explore(model, torch.randn(4, 8), repeats=0, debounce_s=0.01)
    ex.table.row("0").freeze.value = True
    assert ex.wait(60) and ex.state == "done"
    first = ex.entry
    ex.table.row("1").freeze.value = True  # a slow run starts ...
    deadline = time.monotonic() + 30
    while ex.state != "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    ex.results.history_plot.source.selected.indices = [1]  # ... and the user picks the first plan
    assert ex.wait(60)
    assert ex.entry is first and ex.plan == first.plan and ex.state == "done"
    assert ex.progress.layout.visibility == "hidden" and ex.cancel_button.disabled


class Flaky(nn.Module):
    """Fails in forward when its weight is frozen: a failing step the user can cause."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if not self.lin.weight.requires_grad:
            raise RuntimeError("flaky layer refuses to run frozen")
        return self.lin(x)


def test_a_failing_step_is_shown_in_the_widget_and_the_model_is_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Flaky(), nn.ReLU())
    ex = explore(model, torch.randn(4, 8), repeats=0, debounce_s=0.01)
    before = ModelSnapshot.capture(model)
    shown = ex.saved_bytes.value
    ex.table.row("1").freeze.value = True
    assert ex.wait(60)
    assert ex.state == "error"
    assert "flaky layer refuses to run frozen" in ex.error and "forward" in ex.error
    assert ex.error_box.layout.display != "none" and "flaky layer" in ex.error_box.value
    assert ex.saved_bytes.value == shown  # the last good numbers stay
    assert before.differences(model) == [] and all(p.requires_grad for p in model.parameters())
    # the failing toggle does not stay on: the controls are back at the plan on display, and the
    # code tab never shows the failed plan
    assert ex.table.row("1").freeze.value is False and ex.plan.replace(name="") == Plan()
    assert "change was undone" in ex.error_box.value
    assert ex.session.history == [] and "freeze" not in ex.code_text.split("\n")[0]
    # the next good choice clears the error
    ex.table.row("0").freeze.value = True
    assert ex.wait(60) and ex.state == "done" and ex.error is None
    assert ex.error_box.layout.display == "none"


def test_nothing_to_differentiate_is_a_one_line_error_in_the_widget(cnn):
    cnn.live.value = False
    cnn.table.row("").freeze.value = True  # every parameter frozen, input without grad
    assert cnn.run_now() is None
    assert cnn.state == "error" and "nothing to differentiate" in cnn.error
    assert not cnn.table.row("").freeze.value  # undone
    cnn.table.row("").freeze.value = True
    with pytest.raises(Exception, match="nothing to differentiate"):
        cnn.run_now(raise_errors=True)


def test_the_kernel_thread_stays_free_while_a_run_goes():
    torch.manual_seed(0)
    model = nn.Sequential(*[Slow(seconds=0.1) for _ in range(4)])
    ex = explore(model, torch.randn(4, 8), repeats=0, debounce_s=0.01)
    ex.table.row("0").freeze.value = True
    start = time.perf_counter()
    ex.table.row("1").freeze.value = True  # a change while one is pending/running returns at once
    assert time.perf_counter() - start < 0.2
    assert threading.current_thread() is threading.main_thread()
    assert ex.wait(60) and ex.state == "done"
    assert ex.session.history[-1].plan.frozen == ("0", "1")


# -- fake mode and the front door ----------------------------------------------------------------
def test_fake_mode_on_the_gpt_demo():
    wl = gpt_workload()
    ex = explore(wl, mode="fake", debounce_s=0.01)
    assert ex.step_time.value == "-"  # no time in fake mode
    assert_shows(ex, measure(wl, "fake", repeats=0))
    ex.table.row("blocks.1").region.value = "full"
    assert ex.wait(120) and ex.state == "done", ex.status.value
    assert_shows(ex, engine(wl, ex.plan, "fake"))


def test_explore_takes_a_model_and_batch_and_refuses_nonsense():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(WorkloadError, match="pass a batch"):
        explore(model)
    with pytest.raises(WorkloadError, match="explore\\(\\) takes"):
        explore(42)
    with pytest.raises(WorkloadError, match="model is on cpu but device='meta'"):
        explore(model, torch.randn(2, 4), device="meta")
    ex = explore(model, torch.randn(2, 4), optimizer="sgd", live=False)
    assert ex.session.workload.optimizer == "sgd" and not ex.live.value
    assert ex.baseline.saved_bytes >= 0


# -- compile budget ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_budget_slider_and_sweep():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ex = explore(model, torch.randn(8, 16), repeats=1, debounce_s=0.01)
    ex.budget.budgets.value = "1, 0"
    ex.budget.sweep_button.click()
    assert ex.wait(300) and ex.state == "done", ex.status.value
    sweep = ex.budget.plot.source.data
    assert sweep["budget"] == [0.0, 1.0]
    entries = ex.session.history
    assert [e.plan.compile_budget for e in entries] == [0.0, 1.0]
    assert sweep["saved_bytes"] == [e.measurement.saved_bytes for e in entries]
    assert sweep["saved_bytes"][0] < sweep["saved_bytes"][1]  # budget 0 recomputes, 1 keeps
    assert ex.plan.compile_budget is None  # a sweep does not change the plan
    ex.budget.enable.value = True  # compile the plan itself at the slider's budget
    assert ex.wait(300) and ex.state == "done", ex.status.value
    assert ex.plan.compile_budget == 0.5 and ex.measurement.compiled
    assert "activation_memory_budget = 0.5" in ex.code_text
    ex.budget.budgets.value = "2"
    ex.budget.sweep_button.click()  # a mistake is said in the panel, nothing runs
    assert "outside [0, 1]" in ex.budget.message.value and not ex.busy
