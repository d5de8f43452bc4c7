"""axolotl YAML <-> a Plan (field names as recorded in ``shared/CONTEXT.md``, "Trainers"; the
axolotl package does not install beside torch 2.13 here, so its schema was not run).

The closest match to a plan: ``micro_batch_size`` -> ``batch_size``, ``sequence_len`` ->
``seq_len``, ``gradient_accumulation_steps``, ``bf16``/``fp16`` -> autocast precision,
``optimizer`` (Hugging Face's names), ``gradient_checkpointing: true | "offload"`` -> full /
offload regions on every layer, ``selective_checkpointing: {save: [ops]}`` -> selective regions
that save those ops, ``activation_offloading`` -> offload regions, ``unfrozen_parameters``
(regexes; everything else frozen) -> ``frozen="*"`` + the matching parameters trainable,
``fsdp_version``/``fsdp_config`` -> the parallel spec. ``adapter: lora`` is reported: the plan
sizes the model as given, so wrap it with peft first.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from memsave_nb.checkpointing import RegionKind, RegionPolicy, show
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from . import hf
from ._common import (
    Exported,
    Imported,
    TrainerConfigError,
    dump,
    every_n_of,
    load_config,
    lora_of,
    name_of,
    parallel_of,
    root_note,
    regions_for,
    table,
    truthy,
    unwritable,
    whole,
)
from .patterns import compile_bounded

__all__ = ["read", "write"]


def read(config: Any, model: nn.Module | None = None, world_size: int | None = None) -> Imported:
    """An axolotl YAML (text, path or dict) -> the plan axolotl runs."""
    d = load_config(config)
    notes: list[str] = []
    kw: dict[str, Any] = {}
    if d.get("micro_batch_size") is not None:
        kw["batch_size"] = whole(d, "micro_batch_size")
    if d.get("sequence_len") is not None:
        kw["seq_len"] = whole(d, "sequence_len")
    kw["accumulation_steps"] = whole(d, "gradient_accumulation_steps", 1)
    bf16, fp16 = d.get("bf16"), truthy(d.get("fp16"), "fp16")
    if bf16 == "auto":
        notes.append("bf16: auto: sized as bf16 (what a bf16-capable GPU picks)")
    bf16 = bf16 == "auto" or truthy(bf16, "bf16")
    if bf16 and fp16:
        raise TrainerConfigError(
            "bf16 and fp16 are both set: axolotl passes both to TrainingArguments, which refuses that"
        )
    kw["precision"] = hf.precision_of(bf16, fp16, hf._model_dtype(model), notes)
    optim = name_of(d, "optimizer")
    if optim is not None:
        if optim in hf.OPTIM:
            kw["optimizer"] = hf.OPTIM[optim]
        else:
            notes.append(f"optimizer={optim!r}: no knob sizes it; the workload's own optimizer is measured")
    ckpt = d.get("gradient_checkpointing")
    if ckpt not in (None, "offload", "offload_disk"):
        ckpt = truthy(ckpt, "gradient_checkpointing")
    save = table(d, "selective_checkpointing").get("save")
    if save is not None and (not isinstance(save, (list, tuple)) or not all(isinstance(o, str) for o in save)):
        raise TrainerConfigError(f"selective_checkpointing.save: must be a list of op names, got {show(save)}")
    regions: dict[str, RegionPolicy] = {}
    if save:
        regions, more = (
            regions_for(model, RegionKind.SELECTIVE) if model is not None else ({}, ["selective regions: pass model="])
        )
        regions = {k: RegionPolicy.save(save) for k in regions}
        notes += more
    elif ckpt in ("offload", "offload_disk"):
        regions, more = regions_for(model, RegionKind.FULL_OFFLOAD)
        notes += more
        notes.append(
            f"gradient_checkpointing: {ckpt}: axolotl checkpoints each layer and moves its inputs off the device "
            "(full_offload)" + ("; offload_disk's disk is sized as host memory" if ckpt == "offload_disk" else "")
        )
    elif ckpt:
        regions, more = regions_for(model, RegionKind.FULL)
        notes += more
    if truthy(d.get("activation_offloading"), "activation_offloading"):
        if regions and all(p.kind is RegionKind.FULL for p in regions.values()):
            regions = {k: RegionPolicy(RegionKind.FULL_OFFLOAD) for k in regions}  # as TRL's: the inputs go
            notes.append("activation_offloading with checkpointing: each checkpointed layer's inputs on the host")
        elif regions:
            notes.append("activation_offloading with these regions: sized as the regions alone")
        else:
            regions, more = regions_for(model, RegionKind.OFFLOAD)
            notes += more
    if regions:
        kw["regions"] = regions
    unfrozen = d.get("unfrozen_parameters")
    if isinstance(unfrozen, str):
        unfrozen = [unfrozen]
    if unfrozen is not None and (not isinstance(unfrozen, list) or not all(isinstance(p, str) for p in unfrozen)):
        raise TrainerConfigError(f"unfrozen_parameters: must be a list of regexes, got {show(unfrozen)}")
    if unfrozen:
        pats = [compile_bounded(p, "unfrozen_parameters") for p in unfrozen]
        kw["frozen"] = ("*",)
        if model is None:
            notes.append("unfrozen_parameters: pass model= to resolve the regexes; the plan freezes nothing")
            kw.pop("frozen")
        else:
            kw["trainable"] = tuple(n for n, _ in model.named_parameters() if any(p.match(n) for p in pats))
    adapter = d.get("adapter")
    lora = lora_of(model)
    if adapter and lora is not None:
        given = {"r": whole(d, "lora_r"), "lora_alpha": d.get("lora_alpha")}
        differ = sorted(k for k, v in given.items() if v is not None and v != lora[k])
        if differ:
            notes.append(
                f"adapter: {show(adapter)}: the model's LoRA differs in {', '.join(differ)} "
                f"({', '.join(f'{k}={lora[k]}' for k in differ)}); the model's is sized"
            )
    elif adapter:
        notes.append(
            f"adapter: {show(adapter)} (r={show(d.get('lora_r'))}): sized on the model as given; wrap it with "
            "peft.get_peft_model(model, LoraConfig(...)) first to size the adapter"
        )
        if adapter == "qlora":
            notes.append("qlora: 4-bit base weights are not sized (the model's own dtype is measured)")
    if d.get("fsdp_version") is not None or d.get("fsdp_config"):
        fsdp = {k[5:] if k.startswith("fsdp_") else k: v for k, v in table(d, "fsdp_config").items()}
        fsdp.setdefault("version", d.get("fsdp_version", 2))
        if "offload_params" in fsdp:
            fsdp["cpu_offload"] = truthy(fsdp.pop("offload_params"), "offload_params")
        kw["parallel"] = parallel_of(fsdp, world_size, model, notes)
    for key in ("deepspeed", "torch_compile", "liger_fused_linear_cross_entropy", "load_in_8bit", "load_in_4bit"):
        if d.get(key):
            notes.append(f"{key}: not sized")
    plan = Plan(name="axolotl", **kw)
    return Imported(plan, plan.parallel, tuple(notes))


def write(plan: Plan, parallel: ParallelSpec | None = None, model: nn.Module | None = None) -> Exported:
    """A plan -> axolotl YAML fields for memory (merge them into your axolotl config)."""
    notes: list[str] = []
    out: dict[str, Any] = {}
    if plan.batch_size is not None:
        out["micro_batch_size"] = plan.batch_size
    if plan.seq_len is not None:
        out["sequence_len"] = plan.seq_len
    if plan.accumulation_steps is not None:
        out["gradient_accumulation_steps"] = plan.accumulation_steps
    if plan.precision is not None:
        out["bf16"] = plan.precision in ("autocast_bf16", "bf16", "bf16_master")
        out["fp16"] = plan.precision == "autocast_fp16"
        if plan.precision in ("bf16", "bf16_master"):
            notes.append(f"precision {plan.precision!r}: axolotl runs bf16 autocast; written as bf16: true")
    if plan.optimizer is not None:
        if plan.optimizer == "sgd_momentum":  # was written as adamw_torch under this note
            out["optimizer"] = "sgd"
            notes.append("sgd with momentum: written as optimizer: sgd (set momentum in optim_args)")
        elif plan.optimizer == "adam":
            out["optimizer"] = "adamw_torch"
            notes.append("optimizer 'adam': written as adamw_torch (with weight_decay 0 it is Adam, same state bytes)")
        elif plan.optimizer in hf._OPTIM_OUT:
            out["optimizer"] = hf._OPTIM_OUT[plan.optimizer]
            if plan.optimizer in hf.EMBED32:  # axolotl builds it through HF Trainer.create_optimizer
                notes.append(hf.embed32_note(plan.optimizer, f"optimizer: {out['optimizer']}"))
            if plan.optimizer == "adamw_foreach":
                notes.append("optimizer 'adamw_foreach': written as adamw_torch (torch picks foreach)")
        else:
            notes.append(f"optimizer {plan.optimizer!r}: no axolotl optimizer runs it; not written")
    kinds = {p.kind for p in plan.regions.values()}
    if RegionKind.SELECTIVE in kinds:
        saves = {frozenset(p.saved_ops) for p in plan.regions.values() if p.kind is RegionKind.SELECTIVE}
        if len(saves) > 1:
            notes.append("selective regions with different saved ops: axolotl takes one list; wrote their union")
        out["gradient_checkpointing"] = True
        out["selective_checkpointing"] = {"save": sorted(set().union(*saves))}
        notes += _coverage(plan, model, RegionKind.SELECTIVE)
    elif RegionKind.FULL_OFFLOAD in kinds:  # axolotl's "offload": checkpointed layers' inputs on the CPU
        out["gradient_checkpointing"] = "offload"
        notes += _coverage(plan, model, RegionKind.FULL_OFFLOAD)
    elif RegionKind.FULL in kinds:
        out["gradient_checkpointing"] = True
        notes += _coverage(plan, model, RegionKind.FULL)
    elif RegionKind.OFFLOAD in kinds:
        out["activation_offloading"] = True
        notes += _coverage(plan, model, RegionKind.OFFLOAD)
    if len(kinds - {RegionKind.NONE}) > 1:
        notes.append("regions of several kinds: axolotl takes one switch; wrote the strongest")
    if plan.frozen == ("*",) and plan.trainable:
        out["unfrozen_parameters"] = [_regex(n) for n in plan.trainable]
    elif plan.frozen or plan.trainable:
        notes.append(
            "frozen parameters other than 'all but these': axolotl's unfrozen_parameters freezes all the rest; not written"
        )
    lora = lora_of(model)
    if lora is not None:
        out.update(
            {
                "adapter": "lora",
                "lora_r": lora["r"],
                "lora_alpha": lora["lora_alpha"],
                "lora_dropout": lora["lora_dropout"],
                "lora_target_modules": lora["target_modules"],
            }
        )
    spec = parallel if parallel is not None else plan.parallel
    if spec is not None:
        if spec.strategy == "fsdp":
            out["fsdp_version"] = 2
            out["fsdp_config"] = {
                "reshard_after_forward": spec.reshard_after_forward,
                "offload_params": spec.cpu_offload,
            }
            root_note(spec, notes)
        notes.append(f"world size {spec.world_size}: launch that many processes; not a config field")
    notes += [n for n in unwritable(plan, seq_field=True) if not n.startswith("frozen")]
    return Exported(dump(out, "yaml"), out, tuple(notes))


def _regex(name: str) -> str:
    """A plan name (a module, a parameter or an fnmatch pattern) as a regex over parameter names."""
    if any(c in name for c in "*?["):
        import fnmatch

        return fnmatch.translate(name)
    return re.escape(name) + r"(\..*)?$"


def _coverage(plan: Plan, model: nn.Module | None, kind: RegionKind) -> list[str]:
    n, notes = every_n_of(plan, model, kind)
    if n not in (None, 1):
        return [f"{kind.value} regions on some layers only: axolotl applies its checkpointing to every layer"]
    return notes
