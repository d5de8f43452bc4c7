"""The "Fit a GPU" panel driven as a user would: choose a target, read the verdict, ask for the max
batch, search, click a Pareto point and see that plan loaded and measured in the explorer."""

from __future__ import annotations

import pytest

from memsave_nb import zoo
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, max_batch
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.tuner_panel import pareto_data

pytestmark = pytest.mark.timeout(300)
TINY_GPT = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


@pytest.fixture()
def explorer():
    return Explorer(Session(zoo.gpt(TINY_GPT, batch_size=4), mode="fake", repeats=0), live=False, debounce_s=0.0)


@pytest.mark.slow
def test_target_verdict_max_batch_search_and_pick():
    # batch 64: 12 MiB of allocator segments, so smaller plans reserve fewer (batch 4 reserves one 2 MiB segment)
    explorer = Explorer(Session(zoo.gpt(TINY_GPT, batch_size=64), mode="fake", repeats=0), live=False, debounce_s=0.0)
    panel = explorer.tuner
    assert explorer.tabs.get_title(len(explorer.tabs.children) - 1) == "Fit a GPU"
    reserved = explorer.measurement.reserved.max_reserved_bytes
    # a preset: 24 GB fits this tiny model
    panel.target_menu.value = 24.0
    assert panel.target_gb.value == 24.0 and "fits" in panel.verdict.value and "does not fit" not in panel.verdict.value
    # a free value one byte short of the CUDA context and the step's reserved memory: does not fit
    gb = (CUDA_CONTEXT_BYTES + reserved - 1) / 2**30
    panel.target_menu.value = 0.0
    panel.target_gb.value = gb
    assert "does not fit" in panel.verdict.value
    # max batch: the same number as the library's bisection
    panel.max_batch_button.click()  # runs on the tuner's worker thread
    assert panel.wait(120)
    expected = max_batch(explorer.session.workload, explorer.plan, Target(gb))
    assert f"max batch that fits: <b>{expected.value}</b>" in panel.max_batch_result.value
    assert 1 <= expected.value < 64 and expected.rule == "allocator replay"  # each probe judged by fit_of, named
    assert "fake-mode probes, allocator replay" in panel.max_batch_result.value
    # the zoo's AdamW ran its single-tensor loop in fake mode: the result says a GPU needs more
    assert len(expected.notes) == 1
    assert panel.max_batch_result.value.count("memsave-search-note") == 1
    assert "single-tensor step" in panel.max_batch_result.value
    # search, then click a fitting point of the front
    result = panel.search(precisions=(None,))  # in this thread (the button runs it on the worker)
    assert result is not None and result.chosen is not None
    assert panel.plot.source.data["peak_bytes"] == pareto_data(result.candidates, result.front)["peak_bytes"]
    index = next(i for i, c in enumerate(panel.candidates) if c.fits and c.plan.active_regions)
    panel.plot.source.selected.indices = [index]  # what a click on the point does
    picked = panel.candidates[index].plan
    assert explorer.plan.active_regions == picked.active_regions
    explorer.run_now(raise_errors=True)
    with picked.apply(explorer.session.workload) as wl:
        expected_peak = measure(wl, mode="fake", repeats=0).peak_bytes
    assert explorer.measurement.peak_bytes == expected_peak
    assert "checkpoint_region" in panel.code.value or "offload_region" in panel.code.value


def test_knobs_survive_loading_into_the_explorer(explorer):
    plan = Plan(regions={"blocks.0": "full"}, batch_size=2, precision="bf16")
    explorer.set_plan(plan)
    assert explorer.plan.batch_size == 2 and explorer.plan.precision == "bf16"
    explorer.run_now(raise_errors=True)
    assert explorer.measurement.peak_split.inputs == 2 * 2 * 32 * 8  # idx + targets at batch 2


def test_the_loss_knob_control_follows_and_edits_the_plan(explorer):
    panel = explorer.tuner
    explorer.set_plan(Plan(loss="chunked", loss_chunk=64))
    assert panel.knob_loss.value == "chunked"
    panel.knob_batch.value = 2
    panel.knob_apply.click()  # the chunk stays the plan's
    assert (explorer.plan.loss, explorer.plan.loss_chunk, explorer.plan.batch_size) == ("chunked", 64, 2)
    panel.knob_loss.value = "full"
    panel.knob_apply.click()  # a full loss has no chunk
    assert (explorer.plan.loss, explorer.plan.loss_chunk) == ("full", None)
    explorer.set_plan(Plan())
    assert panel.knob_loss.label == "as given"


def test_knob_controls_edit_the_plan(explorer):
    panel = explorer.tuner
    panel.knob_batch.value = 2
    panel.knob_precision.value = "bf16"
    panel.knob_optimizer.value = "sgd_momentum"
    panel.knob_apply.click()
    plan = explorer.plan
    assert (plan.batch_size, plan.precision, plan.optimizer) == (2, "bf16", "sgd_momentum")
    explorer.run_now(raise_errors=True)
    n = sum(p.numel() for p in explorer.session.workload.model.parameters())
    m = explorer.measurement
    assert m.peak_split.parameters == 2 * n  # bf16
    assert max(m.timeline.by_category["optimizer_state"]) == 2 * n  # one bf16 momentum buffer
