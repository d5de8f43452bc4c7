"""What each TrainingArguments / SFTConfig field that changes memory becomes (issue 41), checked
against the installed transformers and trl: their optimizer names, TRL's selective-checkpointing
policy, label smoothing, and the fields a round trip keeps."""

from __future__ import annotations

import pytest

from memsave_nb import Plan
from memsave_nb.checkpointing import RegionKind
from memsave_nb.trainers import TrainerConfigError, from_trainer, hf, to_trainer

from .conftest import tiny_llama

MODEL = tiny_llama()
LAYERS = [f"model.layers.{i}" for i in range(4)]


def test_every_optim_value_is_sized_or_says_so_in_one_line():
    transformers = pytest.importorskip("transformers")
    names = [o.value for o in transformers.training_args.OptimizerNames]
    assert len(names) == 41
    sized = 0
    for name in names:
        imp = from_trainer({"optim": name}, MODEL)
        about = [n for n in imp.notes if n.startswith(f"optim={name!r}") or n.startswith(f"optim='{name}'")]
        if name in hf.OPTIM:
            sized += 1
            assert imp.plan.optimizer == hf.OPTIM[name]
        else:
            assert imp.plan.optimizer is None and len(about) == 1 and "no knob sizes" in about[0]
    assert sized == len(hf.OPTIM) >= 6 and set(hf.OPTIM) <= set(names)  # 6 here; 8-bit and Lion knobs add more


def test_trl_selective_checkpointing_saves_what_trls_policy_saves():
    trl_pkg = pytest.importorskip("trl")
    from trl.models.selective_activation_checkpointing import _aten_attention_ops

    imp = from_trainer({"gradient_checkpointing_kwargs": {"selective": True}}, MODEL, trainer="trl")
    assert sorted(imp.plan.regions) == LAYERS
    saved = {f"aten.{op.overloadpacket.__name__}" for op in _aten_attention_ops()}
    for policy in imp.plan.regions.values():
        assert policy.kind is RegionKind.SELECTIVE and set(policy.saved_ops) == saved
    assert trl_pkg  # the policy above is trl's own, read at run time
    with pytest.raises(TrainerConfigError, match="needs gradient_checkpointing=True"):
        from_trainer(
            {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": {"selective": True}},
            MODEL,
            trainer="trl",
        )
    with pytest.raises(TrainerConfigError, match="TRL's"):
        from_trainer(
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"selective": True}}, MODEL, trainer="hf"
        )


def test_label_smoothing_is_sized_as_the_trainers_smoother_and_written_back():
    imp = from_trainer({"label_smoothing_factor": 0.1}, MODEL)
    assert imp.plan.loss == "hf_smooth" and sum("sized as loss='hf_smooth'" in n for n in imp.notes) == 1
    plain = from_trainer({"label_smoothing_factor": 0.0}, MODEL)
    assert plain.plan.loss is None and not any("LabelSmoother" in n for n in plain.notes)
    written = to_trainer(imp.plan, "hf", model=MODEL).fields
    assert written["label_smoothing_factor"] > 0 and from_trainer(written, MODEL).plan == imp.plan


def test_max_length_none_is_no_truncation_and_bf16_false_over_fp32_is_fp32():
    imp = from_trainer({"max_length": None, "bf16": False}, MODEL, trainer="trl")
    assert imp.plan.seq_len is None and imp.plan.precision == "fp32"


@pytest.mark.parametrize("trainer", ["hf", "trl", "axolotl"])
def test_accumulation_none_and_one_round_trip_to_the_same_plan(trainer):
    plans = [
        from_trainer(
            to_trainer(Plan(batch_size=2, accumulation_steps=acc), trainer).fields, MODEL, trainer=trainer
        ).plan
        for acc in (None, 1)
    ]
    assert plans[0] == plans[1] and plans[0].accumulation_steps == 1


@pytest.mark.parametrize(
    "field, value, trainer",
    [
        ("torch_compile", True, "hf"),
        ("use_liger_kernel", True, "hf"),
        ("deepspeed", "ds.json", "hf"),
        ("optim_args", "momentum=0.9", "hf"),
        ("packing", True, "trl"),
        ("padding_free", True, "trl"),
    ],
)
def test_fields_that_change_memory_but_are_not_sized_are_one_note_each(field, value, trainer):
    notes = from_trainer({field: value}, MODEL, trainer=trainer).notes
    assert sum(n.startswith(f"{field}:") for n in notes) == 1
    assert not any(n.startswith(f"{field}:") for n in from_trainer({}, MODEL, trainer=trainer).notes)
