"""The GPUs tab's "find a layout" row: the layout planner's answer for the tab's GPU count, a GPU
kind and the Fit-a-GPU target, shown as a picture, the front table and the chosen layout's code."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

import html

import torch

from memsave_nb import Plan
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.planner import plan_layout
from memsave_nb.target import Target
from memsave_nb.ui.parallel_panel import ParallelPanel
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPT, GPTConfig

TARGET = Target(2 * 2**20 / 2**30, headroom=1.0)  # 2 MiB per GPU: some layouts fit, the fastest do not


def _gpt() -> Workload:
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.block_size))
    return Workload(model, {"idx": idx, "targets": idx}, name="gpt")


def test_find_a_layout_shows_the_planners_answer_for_the_tabs_gpus_and_target():
    wl = _gpt()
    before = ModelSnapshot.capture(wl.model)
    panel = ParallelPanel(wl, plan_fn=lambda: Plan(), live=False, target_fn=lambda: TARGET)
    panel.gpus.value = 4
    finder = panel.layouts
    finder.gpu.value = "A100"
    finder.find()
    expected = plan_layout(wl, 4, "A100", TARGET)
    got = finder.result
    assert got is not None and got.chosen is not None, finder.status.value
    assert got.gpus == 4 and got.device.name == expected.device.name and got.target == TARGET
    assert got.chosen.label == expected.chosen.label and got.chosen.fits
    assert [c.label for c in got.front] == [c.label for c in expected.front]
    assert "chosen" in finder.status.value and "memsave-layout-chosen" in finder.front.value
    assert "fully_shard" in finder.code.value and finder.code.layout.display is None
    assert len(finder.figure_box.children) == 1
    assert before.differences(wl.model) == []  # the search leaves the model as it was


def test_a_search_that_cannot_run_is_one_line_and_clears_the_old_answer():
    panel = ParallelPanel(_gpt(), plan_fn=lambda: Plan(), live=False, target_fn=lambda: TARGET)
    finder = panel.layouts
    panel.gpus.value = 4
    finder.find()
    assert finder.result is not None
    finder._gpus_fn = lambda: 0  # no GPUs at all: refused before anything is built
    finder.find()
    assert finder.result is None and "#b00" in finder.status.value
    assert finder.status.value.count("<br>") == 0
    assert finder.figure_box.children == () and finder.front.value == "" and finder.code.value == ""


@pytest.mark.slow  # three searches, about 40 s CPU
def test_find_a_layout_starts_from_the_explorers_plan():
    """The explorer's plan (here: every block frozen) reaches the planner: its freezing is on every
    candidate and in the code, the screen says it was kept, and the answer is the planner's for that
    plan, not for the workload as loaded (fewer gradients and optimizer state: lower peaks, and a
    layout the lower bound pruned with everything training is searched)."""
    wl = _gpt()
    frozen = Plan(frozen=("blocks",))
    panel = ParallelPanel(wl, plan_fn=lambda: frozen, live=False, target_fn=lambda: TARGET)
    panel.gpus.value = 4
    finder = panel.layouts
    finder.gpu.value = "A100"
    finder.find()
    got = finder.result
    expected = plan_layout(wl, 4, "A100", TARGET, plan=frozen)
    as_loaded = plan_layout(wl, 4, "A100", TARGET)
    assert got is not None and got.chosen is not None, finder.status.value
    assert got.chosen.plan.frozen == ("blocks",) and all(c.plan.frozen == ("blocks",) for c in got.candidates)
    assert got.chosen.label == expected.chosen.label and [c.label for c in got.front] == [
        c.label for c in expected.front
    ]
    assert "requires_grad_(False)" in finder.code.value
    assert "explorer&#x27;s plan (kept: freeze blocks)" in finder.status.value
    assert min(c.est_peak_bytes for c in got.front) < min(c.est_peak_bytes for c in as_loaded.front)
    assert any(p.startswith("DDP") for p in as_loaded.pruned) and not any(p.startswith("DDP") for p in got.pruned)
    assert all(not c.plan.frozen for c in as_loaded.candidates)


def test_a_plan_the_layout_search_cannot_start_from_is_one_line():
    wl = _gpt()
    some = Plan(regions={"blocks.0": "full"})  # one block of two checkpointed: blocks unlike
    panel = ParallelPanel(wl, plan_fn=lambda: some, live=False, target_fn=lambda: TARGET)
    panel.gpus.value = 4
    panel.layouts.find()
    assert panel.layouts.result is None and "every block is checkpointed alike" in panel.layouts.status.value


def test_pipeline_stages_asked_for_show_the_chosen_layouts_stages_and_their_peaks():
    """ "only 2, 4, 8" searches pipelines alone: the chosen PP 2 layout's label, stages and bubble are in
    the status and the front, and each stage's re-measured peak is in the per-rank table."""
    from memsave_nb.ui.format import format_bytes
    from memsave_nb.ui.layout_panel import STAGES
    from memsave_nb.ui.parallel_view import layout_figure

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    wl = Workload(model, {"idx": idx, "targets": idx}, name="gpt")
    panel = ParallelPanel(wl, plan_fn=lambda: Plan(), live=False, target_fn=lambda: Target(80))
    panel.gpus.value = 2
    finder = panel.layouts
    assert [w for w, _ in STAGES] == list(finder.stages.options) and finder.stages.value == "auto"
    finder.stages.value = "only 2, 4, 8"
    finder.find()
    got = finder.result
    assert got is not None and got.chosen is not None, finder.status.value
    c = got.chosen
    assert c.pipeline_stages == 2 and all(x.pipeline_stages == 2 for x in got.candidates)
    assert "PP 2" in c.label and "bubble" in finder.status.value and html.escape(c.label) in finder.status.value
    assert f"2 stages, bubble {c.bubble_seconds:.3g} s" in finder.front.value
    hover = layout_figure(got).select_one({"name": "layout_chosen"}).data_source.data
    assert hover["bubble_label"] == [f"2 stages, bubble {c.bubble_seconds:.3g} s of {c.step_seconds:.3g} s"]
    ranks = finder.ranks.value
    assert "rank 0 (stage 0)" in ranks and "rank 1 (stage 1)" in ranks
    for r in got.remeasured.ranks:  # each stage's own peak, as measured
        assert format_bytes(r.device_bytes) in ranks
    assert len(got.remeasured.ranks) == 2
    assert finder.code.value and finder.code.layout.display is None  # the code, or why it is not written yet
