"""accelerate config YAML <-> a Plan (accelerate 1.16's ``commands/config/config_args.py``).

An accelerate config holds the launch, not the training loop: ``mixed_precision`` ->
precision, ``distributed_type`` (``FSDP`` / ``MULTI_GPU``) + ``num_processes`` -> the parallel
spec, ``fsdp_config`` (``fsdp_version``, ``fsdp_activation_checkpointing`` -- every block,
``fsdp_offload_params``, ``fsdp_reshard_after_forward``, ``fsdp_transformer_layer_cls_to_wrap``).
Batch size, optimizer and accumulation live in the user's script and are reported as such.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memsave_nb.checkpointing import RegionKind, show
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from ._common import (
    Exported,
    Imported,
    dump,
    every_n_of,
    load_config,
    name_of,
    parallel_of,
    root_note,
    regions_for,
    table,
    truthy,
    unwritable,
    whole,
    wrap_classes,
)

__all__ = ["read", "write"]

_PRECISION_IN = {"no": "fp32", "bf16": "autocast_bf16", "fp16": "autocast_fp16"}
_PRECISION_OUT = {"fp32": "no", "autocast_bf16": "bf16", "autocast_fp16": "fp16", "bf16": "bf16", "bf16_master": "bf16"}


def read(config: Any, model: nn.Module | None = None, world_size: int | None = None) -> Imported:
    """An accelerate config (YAML text, path or dict) -> the plan its launch runs."""
    d = load_config(config)
    notes: list[str] = []
    kw: dict[str, Any] = {}
    mp = (name_of(d, "mixed_precision") or "no").lower()
    if mp in _PRECISION_IN:
        kw["precision"] = _PRECISION_IN[mp]
    else:
        notes.append(f"mixed_precision={show(mp)}: not sized; the workload's precision is measured")
    dist = (name_of(d, "distributed_type") or "NO").upper()
    n = world_size if world_size is not None else whole(d, "num_processes")
    if dist == "FSDP":
        fsdp = {k[5:] if k.startswith("fsdp_") else k: v for k, v in table(d, "fsdp_config").items()}
        fsdp["cpu_offload"] = truthy(fsdp.pop("offload_params", False), "fsdp_offload_params")
        kw["parallel"] = parallel_of(fsdp, n, model, notes)
        if truthy(fsdp.get("activation_checkpointing"), "fsdp_activation_checkpointing"):
            kw["regions"], more = regions_for(model, RegionKind.FULL)
            notes += more
    elif dist == "MULTI_GPU":
        if n is None:
            n = ParallelSpec.world_size
            notes.append(f"num_processes not set: sized for {n} ranks (pass world_size=)")
        kw["parallel"] = ParallelSpec(world_size=n, strategy="ddp")
    elif dist not in ("NO", "MULTI_CPU"):
        notes.append(f"distributed_type={show(dist)}: not sized (the project sizes FSDP2 and DDP)")
    notes.append(
        "batch size, optimizer and accumulation: in your script, not the accelerate config; the workload's are measured"
    )
    plan = Plan(name="accelerate", **kw)
    return Imported(plan, plan.parallel, tuple(notes))


def write(plan: Plan, parallel: ParallelSpec | None = None, model: nn.Module | None = None) -> Exported:
    """A plan -> an accelerate config YAML (``accelerate launch --config_file``)."""
    notes: list[str] = []
    spec = parallel if parallel is not None else plan.parallel
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "mixed_precision": _PRECISION_OUT.get(plan.precision or "fp32", "no"),
    }
    if plan.precision == "bf16":
        notes.append(
            "precision 'bf16': load the model in bfloat16 in your script; mixed_precision=bf16 then runs it pure bf16"
        )
    if plan.precision == "bf16_master":
        notes.append("precision 'bf16_master': accelerate keeps no fp32 master copy; wrote mixed_precision=bf16")
    full_n, more = every_n_of(plan, model, RegionKind.FULL)
    notes += more
    if spec is None:
        out["distributed_type"] = "NO"
        out["num_processes"] = 1
        if full_n is not None:
            notes.append(
                "activation checkpointing without FSDP: not an accelerate config field; "
                "call model.gradient_checkpointing_enable() in your script"
            )
    elif spec.strategy == "ddp":
        out["distributed_type"] = "MULTI_GPU"
        out["num_processes"] = spec.world_size
    else:
        out["distributed_type"] = "FSDP"
        out["num_processes"] = spec.world_size
        cfg: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": spec.reshard_after_forward,
            "fsdp_offload_params": spec.cpu_offload,
        }
        classes = wrap_classes(spec, model, notes)
        root_note(spec, notes)
        if classes:
            cfg["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
        if full_n is not None:
            cfg["fsdp_activation_checkpointing"] = True
            if full_n != 1:
                notes.append(
                    f"every {full_n}-th layer checkpointed: FSDP's activation checkpointing takes every block; "
                    "wrote it on (more recompute, less memory than the plan)"
                )
        if spec.replicate > 1:
            notes.append(f"HSDP replicate={spec.replicate}: set parallelism_config in your script; written as FSDP2")
        out["fsdp_config"] = cfg
    if any(p.kind is RegionKind.SELECTIVE for p in plan.regions.values()):
        notes.append(
            "selective (per-op) checkpointing: not an accelerate field; apply the plan's regions in your script"
        )
    for kind in (RegionKind.OFFLOAD, RegionKind.FULL_OFFLOAD):
        if any(p.kind is kind for p in plan.regions.values()):
            notes.append(f"{kind.value} regions: not an accelerate field; apply the plan's regions in your script")
    for knob in ("batch_size", "accumulation_steps", "optimizer", "seq_len"):
        if getattr(plan, knob) is not None:
            notes.append(f"{knob}={getattr(plan, knob)}: set it in your script (accelerate's config has no such field)")
    notes += unwritable(plan, seq_field=True)
    return Exported(dump(out, "yaml"), out, tuple(notes))
