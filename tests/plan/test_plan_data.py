"""Plans as data: construction, validation at the boundary, JSON, presets' names, SAC policies."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from memsave_nb import presets
from memsave_nb.checkpointing import (
    POLICY_PRESETS,
    OpChoice,
    PlanError,
    RegionKind,
    RegionPolicy,
    make_policy_fn,
    op_name,
    suggest_regions,
)
from memsave_nb.plan import Plan, selects

from plan_cases import CASES, TinyAdapterMLP, TinyCNN

aten = torch.ops.aten


def test_names_are_normalised_once():
    plan = Plan(frozen="*", trainable=["head", "head"], bn_eval=True, memsave=False, compile_budget=0)
    assert plan.frozen == ("*",)
    assert plan.trainable == ("head",)
    assert plan.bn_eval == ("*",)
    assert plan.memsave == ()
    assert plan.compile_budget == 0.0 and isinstance(plan.compile_budget, float)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compile_budget": 1.5}, "[0, 1]"),
        ({"compile_budget": True}, "compile_budget"),
        ({"regions": {"blocks.*": "full"}}, "pattern"),
        ({"regions": {"blocks.0": "fast"}}, "preset"),
        ({"regions": {"blocks.0": {"kind": "selective", "ops": {"aten.mm.default": "save"}}}}, "aten.mm.default"),
        ({"regions": {"blocks.0": {"kind": "full", "ops": {"aten.mm": "save"}}}}, "no per-op"),
        ({"regions": {"blocks.0": {"kind": "selective", "ops": {"aten.mm": "keep"}}}}, "keep"),
        ({"input_requires_grad": "yes"}, "input_requires_grad"),
        ({"frozen": [1]}, "not a name"),
    ],
)
def test_bad_choices_raise_at_construction(kwargs, message):
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        Plan(**kwargs)


def test_validate_names_the_unknown_name():
    model = TinyCNN()
    Plan(frozen=["stem", "blocks.0.0.weight", "*.bias"], bn_eval=["blocks"], regions={"blocks.1": "full"}).validate(
        model
    )
    for plan, name in [
        (Plan(frozen=["stemm"]), "stemm"),
        (Plan(trainable=["blocks.7"]), "blocks.7"),
        (Plan(trainable=["*.lora*"]), "*.lora*"),
        (Plan(bn_eval=["stem.0.weight"]), "stem.0.weight"),  # a parameter is no module
        (Plan(memsave=["trunk"]), "trunk"),
        (Plan(regions={"blocks.2": "full"}), "blocks.2"),
    ]:
        with pytest.raises(PlanError, match=name.replace("*", r"\*").replace(".", r"\.")):
            plan.validate(model)


def test_json_round_trip_and_no_pickle():
    plan = Plan(
        name="mixed",
        frozen=["*"],
        trainable=["head", "*.bias"],
        input_requires_grad=True,
        bn_eval=["stem"],
        memsave=["blocks"],
        regions={
            "blocks.0": "full",
            "blocks.1": RegionPolicy(RegionKind.SELECTIVE, {"aten.mm": "save", "aten.gelu": "recompute"}, "save"),
            "stem": "none",
        },
        compile_budget=0.5,
    )
    text = plan.to_json(indent=2)
    data = json.loads(text)
    assert data["version"] == 1
    assert data["regions"]["blocks.1"] == {
        "kind": "selective",
        "ops": {"aten.gelu": "recompute", "aten.mm": "save"},
        "default": "save",
    }
    again = Plan.from_json(text)
    assert again == plan
    assert hash(again) == hash(plan)
    with pytest.raises(PlanError, match="unknown fields"):
        Plan.from_json('{"frozen": [], "pickle": "x"}')
    with pytest.raises(PlanError, match="does not parse"):
        Plan.from_json("{not json")
    with pytest.raises(PlanError, match="version"):
        Plan.from_json('{"version": 99}')


def test_selects_module_names_select_their_parameters():
    assert selects("blocks.0.conv.weight", ["blocks.0"])
    assert not selects("blocks.10.weight", ["blocks.1"])
    assert selects("anything", [""]) and selects("anything.at.all", ["*"])
    assert selects("layers.0.base.bias", ["*.bias"]) and not selects("layers.0.base.weight", ["*.bias"])


def test_policy_fn_compares_overload_packets_not_overloads():
    """The pitfall: the policy receives aten.mm.default; it must still be saved."""
    fn = make_policy_fn(POLICY_PRESETS["save_matmuls"])
    assert fn(None, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert fn(None, aten.addmm.default) is CheckpointPolicy.MUST_SAVE
    assert fn(None, aten.gelu.default) is CheckpointPolicy.PREFER_RECOMPUTE
    custom = make_policy_fn(RegionPolicy(RegionKind.SELECTIVE, {"aten.gelu": "recompute"}, OpChoice.SAVE))
    assert custom(None, aten.gelu.default) is CheckpointPolicy.PREFER_RECOMPUTE
    assert custom(None, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert op_name(aten.mm.default) == "aten.mm" == op_name(aten.mm)


def test_policy_presets_by_label():
    assert RegionPolicy.from_dict("save matmuls") == POLICY_PRESETS["save_matmuls"]
    assert RegionPolicy.from_dict("Recompute-All").kind is RegionKind.SELECTIVE
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in POLICY_PRESETS["save_compute_intensive"].saved_ops
    assert "aten.convolution" in POLICY_PRESETS["save_compute_intensive"].saved_ops


def test_suggest_regions_finds_repeated_blocks():
    from plan_cases import _gpt

    assert suggest_regions(_gpt().model) == ["blocks.0", "blocks.1"]
    assert suggest_regions(TinyCNN()) == ["blocks.0", "blocks.1"]
    assert suggest_regions(TinyAdapterMLP()) == ["layers.0", "layers.1", "layers.2"]
    assert suggest_regions(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []


def test_presets_name_what_they_should():
    cnn = TinyCNN()
    assert presets.head_only(cnn).trainable == ("head",)
    assert presets.bias_only(cnn).trainable == (
        "stem.0.bias",
        "stem.1.bias",
        "blocks.0.1.bias",
        "blocks.1.1.bias",
        "head.bias",
    )
    assert presets.norm_only(cnn).trainable == ("stem.1", "blocks.0.1", "blocks.1.1")
    layers = presets.parameterised_layers(cnn)  # 6 layers: quarter = 2
    assert presets.first_quarter(cnn).trainable == tuple(layers[:2])
    assert presets.last_quarter(cnn).trainable == tuple(layers[-2:])
    assert presets.last_blocks(cnn, 1).trainable == ("blocks.1",)
    assert presets.input_only(cnn, bn_eval=True).bn_eval == ("*",)
    adapter = TinyAdapterMLP()
    assert presets.lora_only(adapter).trainable == tuple(f"layers.{i}.lora_{ab}" for i in range(3) for ab in "ab")
    assert not presets.has_adapters(cnn)
    with pytest.raises(PlanError, match="adapter"):
        presets.lora_only(cnn)
    assert "adapters only (LoRA)" in presets.presets_for(adapter)
    assert "adapters only (LoRA)" not in presets.presets_for(cnn)
    assert "input only, BN eval" in presets.presets_for(cnn)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_preset_validates_against_its_model(case):
    model = case.make().model
    for label, plan in presets.presets_for(model).items():
        plan.validate(model)
        assert plan.name == label
        assert Plan.from_json(plan.to_json()) == plan


def test_describe_reads_like_a_sentence():
    assert Plan().describe() == "baseline (no changes)"
    assert Plan().is_empty and Plan(regions={"a": "none"}).is_empty
    text = Plan(frozen="*", trainable="head", regions={"b.0": "full", "b.1": "full"}, compile_budget=0.25).describe()
    assert text == "freeze *; train head; checkpoint 2 regions (full); compile budget 0.25"


def test_random_plans_survive_json_and_validate():
    from hypothesis import given, settings
    from test_plan_apply import plans

    model = TinyCNN()

    @settings(max_examples=50, deadline=None, derandomize=True)
    @given(plan=plans(model))
    def check(plan):
        plan.validate(model)
        again = Plan.from_json(plan.to_json())
        assert again == plan and again.describe() == plan.describe()
        compile(plan.to_code(), "<plan>", "exec", dont_inherit=True)  # the snippet is valid Python

    check()
