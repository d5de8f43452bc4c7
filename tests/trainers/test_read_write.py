"""Trainer configs <-> plans, without running a trainer: defaults read from the installed
packages, round trips over random plans, and what each side cannot express reported."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsave_nb import Plan
from memsave_nb.checkpointing import RegionKind, RegionPolicy
from memsave_nb.errors import MemsaveError
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.trainers import TrainerConfigError, detect, from_trainer, hf, to_trainer, trl

from .conftest import LAYERS, tiny_llama

LAYER_NAMES = [f"model.layers.{i}" for i in range(LAYERS)]
MODEL = tiny_llama()


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_hf_defaults_are_the_installed_training_arguments():
    transformers = pytest.importorskip("transformers")
    d = _defaults(transformers.TrainingArguments)
    assert {k: d[k] for k in hf.DEFAULTS} == hf.DEFAULTS


def test_trl_defaults_are_the_installed_sft_config():
    trl_pkg = pytest.importorskip("trl")
    d = _defaults(trl_pkg.SFTConfig)
    assert d["gradient_checkpointing"] is True and d["max_length"] == trl.DEFAULTS["max_length"]
    assert d["loss_type"] == trl.DEFAULTS["loss_type"]
    assert trl_pkg.SFTConfig(output_dir="/tmp/x", use_cpu=True).bf16 is True  # bf16 unless fp16


def test_every_n_layers_names_the_layers_transformers_checkpoints(llama):
    imp = from_trainer(
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 3}}, llama
    )
    assert sorted(imp.plan.regions) == ["model.layers.0", "model.layers.3"]
    # the same layers the model itself flags (transformers' _set_gradient_checkpointing)
    llama.activation_checkpointing_enable(every_n_layers=3)
    flagged = [
        n
        for n, m in llama.named_modules()
        if n.startswith("model.layers.") and n.count(".") == 2 and m.gradient_checkpointing
    ]
    assert flagged == sorted(imp.plan.regions)


def test_legacy_fsdp_string_and_sft_object():
    trl_pkg = pytest.importorskip("trl")
    cfg = trl_pkg.SFTConfig(
        output_dir="/tmp/x",
        use_cpu=True,
        per_device_train_batch_size=3,
        max_length=128,
        gradient_accumulation_steps=4,
        optim="adafactor",
    )
    imp = from_trainer(cfg, MODEL)
    p = imp.plan
    assert (p.batch_size, p.seq_len, p.accumulation_steps, p.optimizer, p.precision) == (
        3,
        128,
        4,
        "adafactor",
        "autocast_bf16",
    )
    assert sorted(p.regions) == LAYER_NAMES  # SFTConfig checkpoints by default
    assert (p.loss, p.loss_chunk) == ("trl_cpu", None)  # TRL's default loss_type, its head as it runs on the CPU
    assert any("fused LM head" in n for n in imp.notes)
    legacy = from_trainer(
        {"fsdp": "full_shard auto_wrap offload", "fsdp_config": {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}},
        MODEL,
        world_size=4,
    )
    # full_shard: accelerate reshards the units and the root after forward
    assert legacy.parallel == ParallelSpec(
        world_size=4, shard_modules=tuple(LAYER_NAMES), cpu_offload=True, reshard_root=True
    )


def test_both_checkpointing_switches_are_refused_and_never_written():
    with pytest.raises(TrainerConfigError, match="both on"):
        from_trainer(
            {"activation_checkpointing": True, "fsdp": True, "fsdp_config": {"activation_checkpointing": True}}, MODEL
        )
    plan = Plan(regions={n: "full" for n in LAYER_NAMES}, parallel=ParallelSpec(world_size=2))
    out = to_trainer(plan, "hf", model=MODEL).fields
    assert "activation_checkpointing" not in out and out["fsdp_config"]["activation_checkpointing"] is True
    assert from_trainer(out, MODEL, world_size=2).plan.regions == plan.regions


def test_what_hf_cannot_express_is_reported_not_dropped():
    plan = Plan(
        regions={"model.layers.1": RegionPolicy.save(["aten.mm"]), "model.layers.2": "full"},
        frozen=["model.embed_tokens"],
        memsave="*",
        compile_budget=0.5,
        seq_len=32,
    )
    exp = to_trainer(plan, "hf", model=MODEL)
    text = " | ".join(exp.notes)
    for phrase in ("selective", "every n-th", "requires_grad", "convert", "compile budget", "sequence length 32"):
        assert phrase in text
    assert json.loads(exp.text) == exp.fields
    assert exp.fields["activation_checkpointing_kwargs"].get("every_n_layers", 1) == 2  # covers layer 2: 0 and 2


def test_bad_input_is_one_line_error(tmp_path):
    for bad in ([1, 2], "[1, 2]", str(tmp_path / "missing.json"), "a: [b"):
        with pytest.raises(MemsaveError) as info:
            from_trainer(bad, trainer="hf")
        assert "\n" not in str(info.value)
    with pytest.raises(MemsaveError, match="unknown trainer"):
        to_trainer(Plan(), "deepspeed")
    with pytest.raises(MemsaveError, match="bf16 and fp16"):
        from_trainer({"bf16": True, "fp16": True}, trainer="hf")


def test_detect():
    assert detect({"micro_batch_size": 1}) == "axolotl"
    assert detect("distributed_type: FSDP\nmixed_precision: bf16\n") == "accelerate"
    assert detect({"max_length": 10}) == "trl"
    assert detect({"per_device_train_batch_size": 1}) == "hf"


def test_trl_loss_types_map_to_the_loss_knob_and_back():
    """trl 1.16: 'nll' (the default) and 'dft' run the fused chunked head, on the CPU (use_cpu) by
    torch folds, else by Triton; 'chunked_nll' is its deprecated alias (SFTConfig rewrites it to
    'nll'); label smoothing runs the full logits and a no-grad fused pass."""
    trl_pkg = pytest.importorskip("trl")
    with pytest.warns(FutureWarning, match="chunked_nll"):
        alias = trl_pkg.SFTConfig(output_dir="/tmp/x", use_cpu=True, loss_type="chunked_nll")
    assert alias.loss_type == "nll"
    big = tiny_llama(layers=1)
    big.resize_token_embeddings(151_936)  # Qwen2.5's vocabulary: TRL's tile of 4096 x 32768 is 883 tokens of it
    for cfg in (
        trl_pkg.SFTConfig(output_dir="/tmp/x", use_cpu=True),
        alias,
        {"loss_type": "chunked_nll"},
        trl_pkg.SFTConfig(output_dir="/tmp/x", use_cpu=True, loss_type="dft"),
    ):
        p = from_trainer(cfg, big).plan
        assert (p.loss, p.loss_chunk) == ("trl_cuda" if isinstance(cfg, dict) else "trl_cpu", None)
    smoothed = from_trainer(trl_pkg.SFTConfig(output_dir="/tmp/x", use_cpu=True, label_smoothing_factor=0.1), big)
    assert smoothed.plan.loss == "trl_smooth_cpu" and smoothed.plan.loss_chunk is None
    assert any("through the label smoother" in n for n in smoothed.notes)
    with pytest.raises(TrainerConfigError, match="loss_type 'focal'"):
        from_trainer({"loss_type": "focal"}, big)
    # export writes TRL's name back; SFTConfig takes it and it reads back as the same plan
    plan = Plan(
        batch_size=2,
        seq_len=64,
        precision="autocast_bf16",
        optimizer="adamw_fused",
        accumulation_steps=1,
        loss="trl_cpu",
    )
    exp = to_trainer(plan, "trl", model=big)
    assert exp.fields["loss_type"] == "nll" and exp.fields["use_cpu"] is True and exp.notes == ()
    back = from_trainer(trl_pkg.SFTConfig(output_dir="/tmp/x", **exp.fields), big)
    assert back.plan == plan.replace(name="trl")
    # a loss TRL does not run is said, and the knob's chunk is not a field
    assert any(
        "TRL always computes the loss" in n
        for n in to_trainer(plan.replace(loss=None, loss_chunk=None), "trl", model=big).notes
    )
    chunked = plan.replace(loss="chunked", loss_chunk=883)
    assert any("TRL always computes the loss" in n for n in to_trainer(chunked, "trl", model=big).notes)
    assert any("chunked loss: not a TrainingArguments field" in n for n in to_trainer(chunked, "hf", model=big).notes)


# -- round trips: export then import gives back every choice the trainer can express --------------

every_n = st.sampled_from([None, 1, 2, 3])


@st.composite
def plans(draw, trainer: str) -> Plan:
    kw: dict = {"batch_size": draw(st.integers(1, 64)), "accumulation_steps": draw(st.integers(1, 8))}
    kw["precision"] = draw(st.sampled_from(["fp32", "autocast_bf16", "autocast_fp16"]))
    kw["optimizer"] = draw(
        st.sampled_from(
            # the Trainer keeps embeddings' 8-bit state in 32 bits: plain adamw_8bit/lion_8bit are not its choices
            ["adamw", "adamw_fused", "adafactor", "adamw_8bit_embed32", "sgd", "lion", "lion_8bit_embed32"]
            + (["sgd_momentum"] if trainer != "axolotl" else [])
        )
    )
    if trainer == "hf":
        kw["loss"] = draw(st.sampled_from([None, "hf_smooth"]))
    n = draw(every_n)
    kind = draw(st.sampled_from([RegionKind.FULL, RegionKind.FULL_OFFLOAD, RegionKind.OFFLOAD]))
    if trainer == "hf" and kind is RegionKind.OFFLOAD:
        kind = RegionKind.FULL_OFFLOAD  # the Trainer offloads only inside its checkpoints (save_on_cpu)
    if trainer == "trl" and kind is RegionKind.FULL_OFFLOAD and n not in (None, 1):
        kind = RegionKind.FULL  # TRL's offloading then also moves the unchecked layers' tensors: offload regions
    if trainer == "trl" and kind is RegionKind.OFFLOAD and n not in (None, 1):
        kind = RegionKind.FULL  # TRL's switch offloads every layer or none
    if trainer == "axolotl":
        n = None if n is None else 1
        if draw(st.booleans()):
            kw["frozen"], kw["trainable"] = (
                ("*",),
                tuple(draw(st.sets(st.sampled_from([n for n, _ in MODEL.named_parameters()]), min_size=1, max_size=4))),
            )
    if trainer in ("trl", "axolotl"):
        kw["seq_len"] = draw(st.integers(1, 4096))
    if trainer == "trl" and kw["precision"] == "fp32":
        kw["precision"] = "autocast_bf16"  # SFTConfig's defaults always write a precision; fp32 round-trips too
    if trainer == "trl":  # every TRL loss_type runs TRL's fused head, by the path of the device
        kw["loss"] = draw(st.sampled_from(["trl_cpu", "trl_cuda", "trl_smooth_cpu", "trl_smooth_cuda"]))
    if n is not None:
        kw["regions"] = {name: RegionPolicy(kind) for i, name in enumerate(LAYER_NAMES) if i % n == 0}
    if draw(st.booleans()):
        kw["parallel"] = ParallelSpec(
            world_size=draw(st.sampled_from([2, 4, 8])),
            reshard_after_forward=draw(st.booleans()),
            cpu_offload=draw(st.booleans()),
            shard_modules=tuple(LAYER_NAMES),
        )
        if trainer == "axolotl":
            kw["parallel"] = dataclasses.replace(kw["parallel"], shard_modules=())
        if kind is RegionKind.OFFLOAD and n is not None and trainer == "axolotl":
            kw.pop("regions")
    return Plan(**kw)


def _as_accelerate_runs(spec):
    """accelerate's FSDP2 plugin reshards the root as the units: a written spec reads back so."""
    return (
        spec
        if spec is None or spec.strategy != "fsdp"
        else dataclasses.replace(spec, reshard_root=spec.reshard_after_forward)
    )


def _same(a: Plan, b: Plan) -> bool:
    norm = lambda p: dataclasses.replace(
        p,
        name="",
        trainable=tuple(sorted(p.trainable)),  # noqa: E731
        parallel=_as_accelerate_runs(p.parallel),
    )
    return norm(a) == norm(b)


@pytest.mark.parametrize("trainer", ["hf", "trl", "axolotl"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip(trainer, data):
    plan = data.draw(plans(trainer))
    exp = to_trainer(plan, trainer, model=MODEL)
    ws = plan.parallel.world_size if plan.parallel else None
    back = from_trainer(exp.text, MODEL, trainer=trainer, world_size=ws)
    if (
        trainer == "axolotl" and back.plan.parallel is not None
    ):  # axolotl names no FSDP classes: the blocks are the default
        back = back._replace(
            plan=dataclasses.replace(back.plan, parallel=dataclasses.replace(back.plan.parallel, shard_modules=()))
        )
    assert _same(back.plan, plan), (exp.text, exp.notes, back.plan, plan)


def test_accelerate_round_trip_and_its_own_parser(tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    plan = Plan(
        precision="autocast_bf16",
        regions={n: "full" for n in LAYER_NAMES},
        parallel=ParallelSpec(
            world_size=4, reshard_after_forward=False, cpu_offload=True, shard_modules=tuple(LAYER_NAMES)
        ),
    )
    exp = to_trainer(plan, "accelerate", model=MODEL)
    path = tmp_path / "accelerate.yaml"
    path.write_text(exp.text)
    parsed = config_args.ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader
    assert parsed.distributed_type == "FSDP" and parsed.num_processes == 4 and parsed.mixed_precision == "bf16"
    assert parsed.fsdp_config["fsdp_version"] == 2
    back = from_trainer(exp.text, MODEL, trainer="accelerate")
    assert back.plan.regions == plan.regions and back.plan.precision == plan.precision
    assert back.parallel == plan.parallel
    assert any("batch size" in n for n in back.notes)


# axolotl's field names as recorded from its source in shared/CONTEXT.md ("Trainers"); the package
# does not install beside torch 2.13 here, so its schema is not run
AXOLOTL_FIELDS = {
    "micro_batch_size",
    "sequence_len",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "optimizer",
    "gradient_checkpointing",
    "selective_checkpointing",
    "activation_offloading",
    "unfrozen_parameters",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "fsdp_version",
    "fsdp_config",
}


def test_axolotl_fields_and_selective_checkpointing():
    plan = Plan(
        batch_size=2,
        seq_len=512,
        regions={n: RegionPolicy.save(["aten.mm"]) for n in LAYER_NAMES},
        frozen="*",
        trainable=["lm_head.weight"],
        parallel=ParallelSpec(world_size=2),
    )
    exp = to_trainer(plan, "axolotl", model=MODEL)
    assert set(exp.fields) <= AXOLOTL_FIELDS
    assert exp.fields["selective_checkpointing"] == {"save": ["aten.mm"]}
    back = from_trainer(exp.text, MODEL, world_size=2)
    assert back.plan.regions == plan.regions and back.plan.trainable == ("lm_head.weight",)
    lora = from_trainer({"micro_batch_size": 1, "adapter": "lora", "lora_r": 8}, MODEL)
    assert any("peft.get_peft_model" in n for n in lora.notes)


def test_a_peft_models_lora_is_written_and_checked():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    layers = [f"base_model.model.{n}" for n in LAYER_NAMES]
    plan = Plan(batch_size=1, seq_len=64, regions={n: "full" for n in layers})
    exp = to_trainer(plan, "axolotl", model=model)
    assert set(exp.fields) <= AXOLOTL_FIELDS
    assert (exp.fields["adapter"], exp.fields["lora_r"], exp.fields["lora_target_modules"]) == (
        "lora",
        4,
        ["q_proj", "v_proj"],
    )
    back = from_trainer(exp.text, model)
    assert back.plan.regions == plan.regions and not any("LoRA" in n or "peft" in n for n in back.notes)
    other = from_trainer(exp.text.replace("lora_r: 4", "lora_r: 16"), model)
    assert any("differs in r (r=4)" in n for n in other.notes)
    sft = to_trainer(plan, "trl", model=model)
    assert any("peft_config=LoraConfig(r=4, lora_alpha=8" in n for n in sft.notes)


@pytest.mark.parametrize("trainer", ["hf", "trl"])
def test_written_fsdp_is_accepted_by_the_arguments_class_and_reads_back(trainer):
    cls = (
        pytest.importorskip("transformers").TrainingArguments
        if trainer == "hf"
        else pytest.importorskip("trl").SFTConfig
    )
    plan = Plan(
        batch_size=2,
        regions={n: "full" for n in LAYER_NAMES},
        parallel=ParallelSpec(
            world_size=4, cpu_offload=True, reshard_after_forward=False, shard_modules=tuple(LAYER_NAMES)
        ),
    )
    fields = to_trainer(plan, trainer, model=MODEL).fields
    args = cls(output_dir="/tmp/memsave_nb_trainers", use_cpu=True, report_to="none", **fields)  # its own checks run
    back = from_trainer(args, MODEL, world_size=4)  # the object after its __post_init__
    assert back.parallel == plan.parallel and back.plan.regions == plan.regions
