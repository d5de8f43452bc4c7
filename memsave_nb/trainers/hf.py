"""Hugging Face ``TrainingArguments`` <-> a Plan (field names from transformers 5.25's
``training_args.py`` and ``trainer.py``).

What maps: ``per_device_train_batch_size`` -> ``batch_size``, ``gradient_accumulation_steps`` ->
``accumulation_steps``, ``bf16``/``fp16`` -> autocast precision (pure bf16 when the model's
parameters are already bf16), ``optim`` -> the optimizers the knobs size,
``activation_checkpointing`` (alias ``gradient_checkpointing``) + ``every_n_layers`` / ``offload``
in its kwargs -> full (or offload) regions on every n-th ``GradientCheckpointingLayer``, ``fsdp`` +
``fsdp_config`` -> an FSDP2 ``ParallelSpec``. The Trainer checkpoints every n-th layer or none:
other region choices, selective (per-op) regions, frozen parameters, memory-saving layers and a
compile budget are not arguments, and come back as notes.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from memsave_nb.checkpointing import RegionKind
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from ._common import (Exported, Imported, TrainerConfigError, dump, every_n_of, load_config, parallel_of,
                      regions_for, truthy, unwritable, wrap_classes)

__all__ = ["DEFAULTS", "OPTIM", "read", "write", "read_fields", "write_fields"]

# TrainingArguments' own defaults for the fields a plan reads (transformers 5.25, torch >= 2.8)
DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "bf16": False,
    "fp16": False,
    "optim": "adamw_torch_fused",
}

# Trainer `optim` name -> the knob that sizes it (same state bytes per parameter)
OPTIM: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw_fused",
    "adafactor": "adafactor",
    "adamw_bnb_8bit": "adamw_8bit",
    "adamw_8bit": "adamw_8bit",
    "sgd": "sgd",
    # bitsandbytes' layouts (measure/optimizers_extra.py); paged ones sized on the device (an upper bound)
    "paged_adamw_8bit": "adamw_8bit", "lion_32bit": "lion", "paged_lion_32bit": "lion",
    "lion_8bit": "lion_8bit", "paged_lion_8bit": "lion_8bit",
}
_OPTIM_OUT = {"adamw": "adamw_torch", "adamw_foreach": "adamw_torch", "adamw_fused": "adamw_torch_fused",
              "adafactor": "adafactor", "adamw_8bit": "adamw_bnb_8bit", "sgd": "sgd", "lion": "lion_32bit",
              "lion_8bit": "lion_8bit"}

# fields that change memory and that no plan field sizes: reported when set
_UNSIZED = {
    "torch_compile": "torch.compile (the plan measures eager; compile_budget is not a Trainer argument)",
    "use_liger_kernel": "Liger kernels (fused cross-entropy and norms: the plan measures the model's own layers)",
    "deepspeed": "DeepSpeed (the plan sizes FSDP2 and DDP only)",
    "optim_args": "optim_args (the knob's optimizer settings are sized instead)",
}


def _model_dtype(model: nn.Module | None) -> Any:
    p = next(iter(model.parameters()), None) if model is not None else None
    return None if p is None else p.dtype


def read_fields(d: Mapping[str, Any], model: nn.Module | None, world_size: int | None,
                defaults: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """Plan keyword arguments from TrainingArguments fields (shared with TRL's SFTConfig)."""
    get = lambda k: d[k] if d.get(k) is not None else defaults.get(k)  # noqa: E731
    kw: dict[str, Any] = {"batch_size": int(get("per_device_train_batch_size")),
                          "accumulation_steps": int(get("gradient_accumulation_steps"))}
    bf16, fp16 = truthy(get("bf16")), truthy(get("fp16"))
    if bf16 and fp16:
        raise TrainerConfigError("bf16 and fp16 are both set: TrainingArguments refuses that")
    import torch

    dtype = _model_dtype(model)
    if bf16:
        kw["precision"] = "bf16" if dtype == torch.bfloat16 else "autocast_bf16"
    elif fp16:
        kw["precision"] = "autocast_fp16"
        if dtype == torch.float16:
            notes.append("fp16 with float16 parameters: sized as fp16 autocast over the model as loaded")
    else:
        kw["precision"] = "bf16" if dtype == torch.bfloat16 else "fp32"
    optim = str(getattr(get("optim"), "value", get("optim")))
    if optim in OPTIM:
        kw["optimizer"] = OPTIM[optim]
        if optim == "adafactor":
            notes.append("optim='adafactor': transformers' Adafactor sized as torch.optim.Adafactor (both factored second moments)")
        if optim.startswith("paged_"):
            notes.append(f"optim={optim!r}: bitsandbytes pages the state of parameters of 1e5+ elements to host memory "
                         "under pressure; sized on the device (an upper bound)")
        if optim == "sgd":
            notes.append("optim='sgd': sized without momentum (momentum in optim_args adds one buffer per parameter)")
    else:
        notes.append(f"optim={optim!r}: no knob sizes it; the workload's own optimizer is measured")
    ckpt = d.get("activation_checkpointing")
    if ckpt is None:
        ckpt = d.get("gradient_checkpointing")
    if ckpt is None:
        ckpt = defaults.get("gradient_checkpointing", False)
    ckpt_kwargs = dict(d.get("activation_checkpointing_kwargs") or d.get("gradient_checkpointing_kwargs") or {})
    fsdp_on, fsdp_cfg = _fsdp(d, notes)
    if fsdp_on and truthy(fsdp_cfg.get("activation_checkpointing")):
        if truthy(ckpt):
            raise TrainerConfigError("activation_checkpointing and fsdp_config['activation_checkpointing'] are both on: "
                                     "the Trainer refuses that; keep the FSDP one")
        ckpt = True
    if truthy(ckpt):
        every_n = int(ckpt_kwargs.pop("every_n_layers", 1))
        offload = truthy(ckpt_kwargs.pop("offload", False))
        kind = RegionKind.OFFLOAD if offload else RegionKind.FULL
        if offload:
            notes.append("checkpointing with offload: the Trainer checkpoints each layer and holds its inputs on the host; "
                         "sized as offloading each layer's saved tensors (same device bytes, more host bytes)")
        kw["regions"], more = regions_for(model, kind, every_n)
        notes += more
        ckpt_kwargs.pop("use_reentrant", None)
        if ckpt_kwargs:
            notes.append(f"checkpoint kwargs {sorted(ckpt_kwargs)}: passed to torch.utils.checkpoint, not sized")
    if fsdp_on:
        kw["parallel"] = parallel_of(fsdp_cfg, world_size, model, notes)
    for key, what in _UNSIZED.items():
        if d.get(key):
            notes.append(f"{key}: {what}")
    return kw


def _fsdp(d: Mapping[str, Any], notes: list[str]) -> tuple[bool, dict[str, Any]]:
    """FSDP on or off and its settings, from the new form (``fsdp=True`` + ``fsdp_config``) or the
    legacy string/list (``"full_shard auto_wrap offload"``), as ``_process_fsdp_args`` reads them."""
    fsdp = d.get("fsdp")
    cfg = d.get("fsdp_config") or {}
    if isinstance(cfg, str):
        cfg = load_config(cfg)
    cfg = {k[5:] if k.startswith("fsdp_") else k: v for k, v in dict(cfg).items()}
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    for item in (str(getattr(i, "value", i)) for i in items):
        if item == "full_shard":
            cfg.setdefault("reshard_after_forward", True)
        elif item == "shard_grad_op":
            cfg.setdefault("reshard_after_forward", False)
        elif item == "offload":
            cfg.setdefault("cpu_offload", True)
        elif item in ("hybrid_shard", "hybrid_shard_zero2"):
            notes.append(f"fsdp {item!r}: FSDP1-only; sized as FSDP2 over one mesh dimension (set replicate= for HSDP)")
        elif item not in ("auto_wrap", "no_shard"):
            notes.append(f"fsdp option {item!r}: not sized")
    return bool(items) or fsdp is True, cfg


def read(config: Any, model: nn.Module | None = None, world_size: int | None = None) -> Imported:
    """``TrainingArguments`` (object, dict, JSON/YAML text or path) -> the plan the Trainer runs."""
    d = load_config(config)
    notes: list[str] = []
    kw = read_fields(d, model, world_size, DEFAULTS, notes)
    notes.append("sequence length: TrainingArguments has none; the workload's batch keeps its own")
    plan = Plan(name="hf", **kw)
    return Imported(plan, plan.parallel, tuple(notes))


# -- export ----------------------------------------------------------------------------------------


def write_fields(plan: Plan, parallel: ParallelSpec | None, model: nn.Module | None,
                 notes: list[str], seq_field: bool = False) -> dict[str, Any]:
    """TrainingArguments fields for a plan (shared with TRL's SFTConfig)."""
    out: dict[str, Any] = {}
    if plan.batch_size is not None:
        out["per_device_train_batch_size"] = plan.batch_size
    if plan.accumulation_steps is not None:
        out["gradient_accumulation_steps"] = plan.accumulation_steps
    if plan.precision is not None:
        out["bf16"] = plan.precision in ("autocast_bf16", "bf16", "bf16_master")
        out["fp16"] = plan.precision == "autocast_fp16"
        if plan.precision == "bf16":
            notes.append("precision 'bf16': load the model with dtype=torch.bfloat16; bf16=True then runs it pure bf16")
        if plan.precision == "bf16_master":
            notes.append("precision 'bf16_master': the Trainer keeps no fp32 master copy; wrote bf16=True "
                         "(load the model in float32 for autocast, or in bfloat16 for pure bf16)")
    if plan.optimizer is not None:
        out["optim"] = _OPTIM_OUT.get(plan.optimizer, "adamw_torch")
        if plan.optimizer == "sgd_momentum":
            out["optim"] = "sgd"
            out["optim_args"] = "momentum=0.9"
        elif plan.optimizer == "adamw_foreach":
            notes.append("optimizer 'adamw_foreach': written as optim='adamw_torch' (torch picks foreach)")
    spec = parallel if parallel is not None else plan.parallel
    fsdp_ckpt = spec is not None and spec.strategy == "fsdp"
    full_n, more = every_n_of(plan, model, RegionKind.FULL)
    notes += more
    off_n, more = every_n_of(plan, model, RegionKind.OFFLOAD)
    notes += more
    if full_n is not None and off_n is not None:
        notes.append("full and offload regions together: the Trainer has one checkpointing switch; wrote the full regions")
        off_n = None
    n = full_n or off_n
    if n is not None:
        if fsdp_ckpt and n == 1 and off_n is None:
            pass  # FSDP's own activation checkpointing, below: the Trainer refuses both switches on
        else:
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if n != 1:
                kwargs["every_n_layers"] = n
            if off_n is not None:
                kwargs["offload"] = True
            out["activation_checkpointing"] = True
            out["activation_checkpointing_kwargs"] = kwargs
            fsdp_ckpt = False
    else:
        fsdp_ckpt = False
    if any(p.kind is RegionKind.SELECTIVE for p in plan.regions.values()):
        notes.append("selective (per-op) checkpointing: not a Trainer argument (all layers or none); "
                     "apply the plan's regions to the model in your script, or use axolotl's selective_checkpointing")
    if spec is not None:
        out.update(_fsdp_fields(spec, fsdp_ckpt, model, notes))
    notes += unwritable(plan, seq_field)
    return out


def _fsdp_fields(spec: ParallelSpec, ckpt: bool, model: nn.Module | None, notes: list[str]) -> dict[str, Any]:
    if spec.strategy == "ddp":
        notes.append(f"DDP x{spec.world_size}: no Trainer argument; launch {spec.world_size} processes (torchrun/accelerate)")
        return {}
    cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": spec.reshard_after_forward}
    if spec.cpu_offload:
        cfg["cpu_offload"] = True
    if ckpt:
        cfg["activation_checkpointing"] = True
    classes = wrap_classes(spec, model, notes)
    if classes:
        cfg["transformer_layer_cls_to_wrap"] = classes
    if spec.replicate > 1:
        notes.append(f"HSDP replicate={spec.replicate}: not a Trainer FSDP2 argument; sized for it, written as FSDP2")
    if spec.param_dtype or spec.reduce_dtype:
        notes.append("FSDP mixed-precision dtypes: follow bf16/fp16, not written separately")
    notes.append(f"world size {spec.world_size}: launch that many processes (torchrun/accelerate); not a Trainer argument")
    return {"fsdp": True, "fsdp_config": cfg}


def write(plan: Plan, parallel: ParallelSpec | None = None, model: nn.Module | None = None) -> Exported:
    """A plan -> ``TrainingArguments`` fields as JSON (``TrainingArguments(**json.loads(text))``)."""
    notes: list[str] = []
    out = write_fields(plan, parallel, model, notes)
    if plan.loss == "chunked":
        notes.append("chunked loss: not a TrainingArguments field (the Trainer computes the model's own loss over the "
                     "full logits); TRL's SFTTrainer chunks it (export 'trl'), or call memsave_nb.loss.use_chunked_loss(model)")
    return Exported(dump(out, "json"), out, tuple(notes))
