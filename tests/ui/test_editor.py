"""The plan editor behind the explorer's controls: boxes <-> Plan fields, both ways."""

from __future__ import annotations

import pytest
from torch import nn

from memsave_nb import zoo
from memsave_nb.checkpointing import OpChoice, RegionKind, policy_preset
from memsave_nb.plan import Plan
from memsave_nb.ui.editor import PlanEditor, op_choice, preset_key
from memsave_nb.ui.tree import slug


@pytest.fixture(scope="module")
def model():
    return zoo.make("cnn", 2).model


@pytest.mark.parametrize(
    "edits, frozen, trainable",
    [
        ([], (), ()),
        ([("layers.0", True)], ("layers.0",), ()),
        ([("", True)], ("",), ()),
        ([("", True), ("head", False)], ("stem", "layers"), ()),
        (
            [("layers.0", True), ("layers.0.1.conv1", False)],
            ("layers.0.0", "layers.0.1.bn1", "layers.0.1.conv2", "layers.0.1.bn2"),
            (),
        ),
        ([("stem", True), ("stem", False)], (), ()),
    ],
)
def test_freeze_boxes_give_the_shortest_names(model, edits, frozen, trainable):
    ed = PlanEditor(model)
    for name, value in edits:
        ed.set_frozen(name, value)
    plan = ed.plan()
    assert (plan.frozen, plan.trainable) == (frozen, trainable)
    # what the plan freezes is what the boxes say
    assert set(plan.trainable_parameter_names(model)) == set(ed.tree.all_params) - ed.frozen_params
    # and loading the plan gives the same boxes back
    assert PlanEditor(model, plan).frozen_boxes() == ed.frozen_boxes()


def test_a_partly_frozen_model_starts_with_its_own_flags():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    m[0].requires_grad_(False)
    ed = PlanEditor(m)
    assert ed.frozen_boxes() == {"": False, "0": True, "1": False}
    assert ed.plan().is_empty  # untouched boxes keep the model's own flags
    ed.set_frozen("0", False)
    assert ed.plan().trainable == ("",) and ed.plan().frozen == ()  # all trainable now
    ed.set_frozen("1", True)
    assert ed.plan().frozen == ("1",) and ed.plan().trainable == ("0",)


@pytest.mark.parametrize(
    "edits, memsave",
    [
        ([("", True)], ("*",)),
        ([("layers.1", True)], ("layers.1.*",)),
        ([("stem.2", True), ("layers.1", True)], ("stem.2", "layers.1.*")),
        ([("", True), ("layers.1", False)], ("stem.*", "layers.0.*", "layers.2.*")),
    ],
)
def test_memsave_switches(model, edits, memsave):
    ed = PlanEditor(model)
    for name, value in edits:
        ed.set_memsave(name, value)
    plan = ed.plan()
    assert plan.memsave == memsave
    assert PlanEditor(model, plan).swapped == ed.swapped
    assert ed.tree.swappable["head"] == []  # Linear has no memory-saving twin
    assert ed.tree.swappable["pool"] == []  # AdaptiveAvgPool2d has no memory-saving twin


def test_regions_and_ops(model):
    ed = PlanEditor(model)
    calls = []
    ed.on_change(lambda: calls.append(1))
    ed.set_region("layers.1", "save_matmuls")
    assert ed.plan().regions == {"layers.1": policy_preset("save_matmuls")}
    assert ed.region_key("layers.1") == "save_matmuls" and ed.region_key("layers.0") == "none"
    ed.set_op("layers.1", "aten.convolution", "save")
    pol = ed.regions["layers.1"]
    assert pol.kind is RegionKind.SELECTIVE and "aten.convolution" in pol.saved_ops and preset_key(pol) == "custom"
    ed.set_op("layers.2", "aten.relu_", "recompute")  # a plain module becomes selective, keeping the rest
    pol2 = ed.regions["layers.2"]
    assert pol2.default is OpChoice.SAVE and pol2.recomputed_ops == {"aten.relu_"}
    assert op_choice(pol2, "aten.relu_") == "recompute" and op_choice(pol2, "aten.convolution") == "save"
    ed.set_region("layers.2", "none")
    assert "layers.2" not in ed.plan().regions
    ed.set_region("layers.0", "full")
    ed.set_op("layers.0", "aten.convolution", "save")  # from full: recompute all but this
    assert ed.regions["layers.0"].default is OpChoice.RECOMPUTE
    assert len(calls) == 6
    assert PlanEditor(model, ed.plan()).regions == ed.regions


def test_other_fields_and_load_round_trip(model):
    plan = Plan(
        name="mine",
        frozen=("stem",),
        input_requires_grad=True,
        bn_eval=("*",),
        memsave=("*",),
        regions={"layers.2": "full"},
        compile_budget=0.5,
    )
    ed = PlanEditor(model, plan)
    assert ed.plan() == plan
    ed.set_compile_budget(None)
    assert ed.plan().compile_budget is None and ed.plan().name == ""  # an edited plan loses its name


def test_slugs_are_css_safe():
    assert slug("") == "root"
    assert slug("layers.0.conv1") == "layers-0-conv1"
    assert slug("a/b c") == "a-b-c"
