"""Issue 42: recomputing one op in the SAC panel raised memory by 1.0 MiB with no explanation. The
panel now says where the bytes went, and the numbers are checked against shapes and torch itself:
the MLP demo (batch 256), region ``3`` (its first-but-one ReLU), ``aten.relu`` recomputed."""

from __future__ import annotations

import pytest
import torch

from memsave_nb import zoo
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mlp_explorer():
    ex = Explorer(Session(zoo.make("mlp"), "real", repeats=0), live=False)
    yield ex
    ex.close()


def test_recomputing_relu_says_why_the_step_keeps_more(mlp_explorer):
    ex = mlp_explorer
    ex._on_select("3")
    assert ex.sac.cost.value == ""  # baseline on display: nothing to explain
    ex.sac.toggle("aten.relu").value = "recompute"
    entry = ex.run_now(raise_errors=True)
    # the oracle: the region's input is the 2nd Linear's output, batch 256 x 1024 float32, and the
    # checkpoint stashes the CPU generator's state, as big as torch.get_rng_state() is
    region_input = 256 * ex.model[2].out_features * 4
    rng = torch.get_rng_state().numel()
    assert region_input == 1_048_576 and rng > 0
    assert entry.measurement.saved_bytes - ex.baseline.saved_bytes == region_input + rng
    text = ex.sac.cost.value
    assert f"(+{region_input + rng:,} B)" in text
    assert f"{rng:,} B the random-number state" in text
    assert f"({region_input:,} B) outside the region: the output of aten.addmm in 2 is kept now" in text
    assert "aten.relu is recomputed but still kept (1.0 MiB)" in text
    # the op's row agrees: relu keeps as much as in eager (the next Linear saves its output)
    row = ex.sac._rows["aten.relu"].info.value
    assert row.count("1.0 MiB") == 2


def test_no_outside_story_when_other_regions_change_too(mlp_explorer):
    ex = mlp_explorer
    ex.set_plan(Plan(regions={"3": "full", "5": "full"}))
    ex.run_now(raise_errors=True)
    ex._on_select("3")
    text = ex.sac.cost.value
    assert "kept for backward" in text and "outside the region" not in text
    ex.set_plan(Plan())
    ex.run_now(raise_errors=True)
    assert ex.sac.cost.value == ""
