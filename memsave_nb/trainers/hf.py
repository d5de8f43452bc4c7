"""Hugging Face ``TrainingArguments`` <-> a Plan (field names from transformers 5.25's
``training_args.py`` and ``trainer.py``).

What maps: ``per_device_train_batch_size`` -> ``batch_size``, ``gradient_accumulation_steps`` ->
``accumulation_steps``, ``bf16``/``fp16`` -> autocast precision (pure bf16 when the model's
parameters are already bf16), ``optim`` -> the optimizers the knobs size,
``activation_checkpointing`` (alias ``gradient_checkpointing``) + ``every_n_layers`` / ``offload``
in its kwargs -> full (or offload) regions on every n-th ``GradientCheckpointingLayer``, ``fsdp`` +
``fsdp_config`` -> an FSDP2 ``ParallelSpec``. Every value is typed as the Trainer types it (one
line for ``"abc"``, 2.5, True, inf, 0), and a name ``TrainingArguments`` does not take is refused
(:mod:`.fields`); ``label_smoothing_factor > 0`` -> ``loss='hf_smooth'`` (the Trainer's
``LabelSmoother`` over the full logits, :func:`memsave_nb.loss.use_label_smoother`); ``optim='sgd'``
with ``optim_args`` momentum -> ``sgd_momentum``. The Trainer checkpoints every n-th layer or none:
other region choices, selective (per-op) regions, frozen parameters, memory-saving layers and a
compile budget are not arguments, and come back as notes.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from memsave_nb.checkpointing import RegionKind, RegionPolicy, show
from memsave_nb.loss_trl import TRL_LOSSES
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from ._common import (
    Exported,
    Imported,
    TrainerConfigError,
    dump,
    every_n_of,
    load_config,
    name_of,
    parallel_of,
    root_note,
    real,
    regions_for,
    table,
    truthy,
    unwritable,
    whole,
    wrap_classes,
)
from .fields import check_fields

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
    "sgd": "sgd",
    # bitsandbytes' layouts (optimizers_extra.py); paged ones sized on the device (an upper bound).
    # optim_bits=8 (trainer_optimizer.py): create_optimizer keeps nn.Embedding weights in 32 bits
    "adamw_bnb_8bit": "adamw_8bit_embed32",
    "adamw_8bit": "adamw_8bit_embed32",
    "paged_adamw_8bit": "adamw_8bit_embed32",
    "lion_32bit": "lion",
    "paged_lion_32bit": "lion",
    "lion_8bit": "lion_8bit_embed32",
    "paged_lion_8bit": "lion_8bit_embed32",
}
_OPTIM_OUT = {
    "adamw": "adamw_torch",
    "adamw_foreach": "adamw_torch",
    "adamw_fused": "adamw_torch_fused",
    "adafactor": "adafactor",
    "adamw_8bit": "adamw_bnb_8bit",
    "adamw_8bit_embed32": "adamw_bnb_8bit",
    "sgd": "sgd",
    "lion": "lion_32bit",
    "lion_8bit": "lion_8bit",
    "lion_8bit_embed32": "lion_8bit",
}
# plan optimizers the Trainer cannot run as sized: its 8-bit bitsandbytes optimizer keeps embeddings in 32 bits
EMBED32 = {"adamw_8bit": "adamw_8bit_embed32", "lion_8bit": "lion_8bit_embed32"}

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


def precision_of(bf16: bool, fp16: bool, dtype: Any, notes: list[str]) -> str:
    """The precision a trainer runs: the model's parameter dtype plus its bf16/fp16 switches
    (autocast over fp32 weights; pure bf16 only when the weights already are bf16)."""
    import torch

    if bf16:
        return "bf16" if dtype == torch.bfloat16 else "autocast_bf16"
    if fp16:
        if dtype == torch.float16:
            notes.append("fp16 with float16 parameters: sized as fp16 autocast over the model as loaded")
        return "autocast_fp16"
    if dtype == torch.bfloat16:
        notes.append("bf16 and fp16 off over bfloat16 parameters: the Trainer runs the model as loaded, pure bf16")
        return "bf16"
    return "fp32"


def optim_of(optim: str, notes: list[str], momentum: float = 0.0) -> dict[str, Any]:
    """The knob that sizes a Trainer ``optim`` value, or a one-line note that none does; a name
    the installed transformers does not know is refused, as ``TrainingArguments`` refuses it.
    ``momentum``: ``optim_args``' for SGD (the Trainer's ``_get_sgd`` passes it to torch's SGD)."""
    names = optim_names()
    if names is not None and optim not in names:
        raise TrainerConfigError(f"optim {show(optim)}: not a TrainingArguments optimizer name")
    if optim in OPTIM:
        if optim == "adafactor":
            notes.append(
                "optim='adafactor': transformers' Adafactor sized as torch.optim.Adafactor (both factored second moments)"
            )
        if optim.startswith("paged_"):
            notes.append(
                f"optim={optim!r}: bitsandbytes pages the state of parameters of 1e5+ elements to host memory "
                "under pressure; sized on the device (an upper bound)"
            )
        if optim == "sgd":
            if momentum:
                return {"optimizer": "sgd_momentum"}
            notes.append("optim='sgd': sized without momentum (momentum in optim_args adds one buffer per parameter)")
        return {"optimizer": OPTIM[optim]}
    notes.append(f"optim={optim!r}: no knob sizes its state; the workload's own optimizer (AdamW) is measured instead")
    return {}


def optim_names() -> frozenset[str] | None:
    """``OptimizerNames`` of the installed transformers; None without it."""
    try:
        from transformers.training_args import OptimizerNames
    except ImportError:
        return None
    return frozenset(o.value for o in OptimizerNames)


def read_fields(
    d: Mapping[str, Any],
    model: nn.Module | None,
    world_size: int | None,
    defaults: Mapping[str, Any],
    notes: list[str],
    *,
    trl: bool = False,
) -> dict[str, Any]:
    """Plan keyword arguments from TrainingArguments fields (shared with TRL's SFTConfig:
    ``trl=True`` reads its ``gradient_checkpointing_kwargs={"selective": True}``)."""
    get = lambda k: d[k] if d.get(k) is not None else defaults.get(k)  # noqa: E731
    kw: dict[str, Any] = {
        "batch_size": whole(d, "per_device_train_batch_size", defaults["per_device_train_batch_size"]),
        "accumulation_steps": whole(d, "gradient_accumulation_steps", 1),
    }
    bf16, fp16 = truthy(get("bf16"), "bf16"), truthy(get("fp16"), "fp16")
    if bf16 and fp16:
        raise TrainerConfigError("bf16 and fp16 are both set: TrainingArguments refuses that")
    kw["precision"] = precision_of(bf16, fp16, _model_dtype(model), notes)
    optim = name_of(d, "optim", defaults["optim"])
    optim_args = optim_args_of(d)
    momentum = 0.0
    if optim == "sgd" and "momentum" in optim_args:
        momentum = _number_in(optim_args, "momentum")
    kw.update(optim_of(optim, notes, momentum))
    if kw.get("optimizer") in EMBED32.values():
        embedding_note(kw["optimizer"], model, notes)
    ckpt = d.get("activation_checkpointing")
    if ckpt is None:
        ckpt = d.get("gradient_checkpointing")
    if ckpt is None:
        ckpt = defaults.get("gradient_checkpointing", False)
    ckpt = truthy(ckpt, "gradient_checkpointing")
    kwargs_key = (
        "activation_checkpointing_kwargs"
        if d.get("activation_checkpointing_kwargs") is not None
        else "gradient_checkpointing_kwargs"
    )
    ckpt_kwargs = table(d, kwargs_key)
    fsdp_on, fsdp_cfg = _fsdp(d, notes)
    if fsdp_on and truthy(fsdp_cfg.get("activation_checkpointing"), "fsdp_config.activation_checkpointing"):
        if ckpt:
            raise TrainerConfigError(
                "activation_checkpointing and fsdp_config['activation_checkpointing'] are both on: "
                "the Trainer refuses that; keep the FSDP one"
            )
        ckpt = True
    selective = truthy(ckpt_kwargs.pop("selective", False), "selective")
    if selective:
        _check_selective(trl, ckpt, ckpt_kwargs)
    if ckpt:
        every_n = whole(ckpt_kwargs, "every_n_layers", 1)
        offload = truthy(ckpt_kwargs.pop("offload", False), "offload")
        ckpt_kwargs.pop("every_n_layers", None)
        kind = RegionKind.FULL_OFFLOAD if offload else RegionKind.FULL
        if offload:  # transformers 5.25 _activation_checkpointing_enable: save_on_cpu around each checkpoint
            notes.append(
                "checkpointing with offload: each layer is checkpointed inside save_on_cpu, so its inputs wait on "
                "the host (full_offload; save_on_cpu moves tensors under 1 KiB too, sized here on the device)"
            )
        kw["regions"], more = regions_for(model, kind, every_n)
        notes += more
        if selective:
            import torch

            ops = [op for op in SAC_SAVED_OPS if hasattr(torch.ops.aten, op.split(".")[1])]
            kw["regions"] = {name: RegionPolicy.save(ops) for name in kw["regions"]}
            notes.append(
                "selective checkpointing (TRL): each checkpointed layer saves its attention op's outputs "
                "and recomputes the rest, as trl's SAC policy does"
            )
        ckpt_kwargs.pop("use_reentrant", None)
        if ckpt_kwargs:
            notes.append(f"checkpoint kwargs {show(sorted(ckpt_kwargs))}: passed to torch.utils.checkpoint, not sized")
    if fsdp_on:
        kw["parallel"] = parallel_of(fsdp_cfg, world_size, model, notes)
    for key, what in _UNSIZED.items():
        if d.get(key) and not (
            key == "optim_args" and kw.get("optimizer") == "sgd_momentum" and set(optim_args) <= _SGD_SIZED
        ):
            notes.append(f"{key}: {what}")
    return kw


def embedding_gap(knob: str, model: nn.Module | None) -> int:
    """Bytes of optimizer state the Trainer's 8-bit bitsandbytes optimizer keeps above the plain 8-bit
    layout: ``create_optimizer`` registers every ``nn.Embedding`` weight for 32-bit state
    (``GlobalOptimManager.register_module_override``); ``*_embed32`` knobs size them."""
    from memsave_nb.optimizers_extra import embedding_weights, state_bytes_per_parameter

    if model is None:
        return 0
    moments = 2 if knob.startswith("adamw") else 1
    return sum(
        state_bytes_per_parameter(w.numel(), moments, 32) - state_bytes_per_parameter(w.numel(), moments, 8)
        for w in embedding_weights(model)
        if w.requires_grad
    )


def embedding_note(knob: str, model: nn.Module | None, notes: list[str]) -> None:
    """One line saying the embeddings' 32-bit state is sized (and its bytes above 8 bits)."""
    gap = embedding_gap(knob, model)
    size = f"{gap:,} B above 8 bits" if model is not None else "pass model= to see their bytes here"
    notes.append(
        f"{knob}: the Trainer keeps nn.Embedding weights' optimizer state in 32 bits (bitsandbytes' module "
        f"override); sized ({size})"
    )


def embed32_note(knob: str, written: str) -> str:
    """Why a plain 8-bit knob reads back as its ``*_embed32`` form (the Trainer's embedding override)."""
    return (
        f"optimizer {knob!r}: wrote {written}; the Trainer keeps nn.Embedding weights' state in 32 bits "
        f"(more memory), read back as {EMBED32[knob]!r}"
    )


_SGD_SIZED = {"momentum", "dampening", "weight_decay", "nesterov"}  # no state beyond the momentum buffer


def optim_args_of(d: Mapping[str, Any]) -> dict[str, str]:
    """``optim_args`` as the Trainer parses it (``_parse_optim_args``: ``"k=v,k=v"``, spaces dropped)."""
    text = d.get("optim_args")
    if text is None or text == "":
        return {}
    if not isinstance(text, str) or len(text) > 500:
        raise TrainerConfigError(f"optim_args: must be text like 'momentum=0.9', got {show(text)}")
    out = {}
    for item in text.replace(" ", "").split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise TrainerConfigError(f"optim_args: {show(item)} is not key=value (the Trainer fails on it)")
        out[key] = value
    return out


def _number_in(args: Mapping[str, str], key: str) -> float:
    import math

    try:
        value = float(args[key])
    except ValueError:
        value = math.nan
    if not 0 <= value < 1e6:
        raise TrainerConfigError(f"optim_args {key}: must be a number of 0 or more, got {show(args[key])}")
    return value


# trl 1.16 models/selective_activation_checkpointing.py: the aten attention ops its policy saves
SAC_SAVED_OPS = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
)


def _check_selective(trl: bool, ckpt: bool, ckpt_kwargs: Mapping[str, Any]) -> None:
    """TRL's ``selective`` key is refused where TRL (or torch, for TrainingArguments) refuses it."""
    if not trl:
        raise TrainerConfigError(
            "gradient_checkpointing_kwargs 'selective' is TRL's (SFTConfig); the Trainer passes it "
            "to torch.utils.checkpoint, which refuses it"
        )
    if not ckpt:
        raise TrainerConfigError(
            "gradient_checkpointing_kwargs 'selective' needs gradient_checkpointing=True (TRL refuses it alone)"
        )
    if truthy(ckpt_kwargs.get("use_reentrant"), "use_reentrant"):
        raise TrainerConfigError("gradient_checkpointing_kwargs 'selective' needs use_reentrant=False (TRL refuses it)")


def _fsdp(d: Mapping[str, Any], notes: list[str]) -> tuple[bool, dict[str, Any]]:
    """FSDP on or off and its settings, from the new form (``fsdp=True`` + ``fsdp_config``) or the
    legacy string/list (``"full_shard auto_wrap offload"``), as ``_process_fsdp_args`` reads them."""
    fsdp = d.get("fsdp")
    cfg = table(d, "fsdp_config")
    cfg = {k[5:] if isinstance(k, str) and k.startswith("fsdp_") else k: v for k, v in cfg.items()}
    if fsdp is not None and not isinstance(fsdp, (bool, str, list, tuple)):
        raise TrainerConfigError(f"fsdp: must be true/false, a string of options or a list, got {show(fsdp)}")
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    for item in (getattr(i, "value", i) for i in items):
        if not isinstance(item, str):
            raise TrainerConfigError(f"fsdp: options must be names, got {show(item)}")
        if item == "full_shard":
            cfg.setdefault("reshard_after_forward", True)
        elif item == "shard_grad_op":
            cfg.setdefault("reshard_after_forward", False)
        elif item == "offload":
            cfg.setdefault("cpu_offload", True)
        elif item in ("hybrid_shard", "hybrid_shard_zero2"):
            notes.append(f"fsdp {item!r}: FSDP1-only; sized as FSDP2 over one mesh dimension (set replicate= for HSDP)")
        elif item not in ("auto_wrap", "no_shard"):
            notes.append(f"fsdp option {show(item)}: not sized")
    return bool(items) or fsdp is True, cfg


def read(config: Any, model: nn.Module | None = None, world_size: int | None = None) -> Imported:
    """``TrainingArguments`` (object, dict, JSON/YAML text or path) -> the plan the Trainer runs."""
    d = load_config(config)
    notes: list[str] = []
    check_fields(config, d, "hf", notes)
    kw = read_fields(d, model, world_size, DEFAULTS, notes)
    smoothing = real(d, "label_smoothing_factor", 0.0, 0.0, 1.0)
    if smoothing > 0:
        kw["loss"] = "hf_smooth"
        notes.append(
            f"label_smoothing_factor={smoothing}: the Trainer's LabelSmoother holds the negated log-softmax "
            "of the full logits (batch x seq x vocab, twice) beside them; sized as loss='hf_smooth'"
        )
    notes.append(
        "sequence length: TrainingArguments has none; it comes from your data (the workload's batch keeps its own)"
    )
    plan = Plan(name="hf", **kw)
    return Imported(plan, plan.parallel, tuple(notes))


# -- export ----------------------------------------------------------------------------------------


def write_fields(
    plan: Plan, parallel: ParallelSpec | None, model: nn.Module | None, notes: list[str], seq_field: bool = False
) -> dict[str, Any]:
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
            notes.append(
                "precision 'bf16_master': the Trainer keeps no fp32 master copy; wrote bf16=True "
                "(load the model in float32 for autocast, or in bfloat16 for pure bf16)"
            )
    if plan.optimizer is not None:
        if plan.optimizer == "sgd_momentum":  # the Trainer's _get_sgd passes optim_args' momentum to torch's SGD
            out["optim"], out["optim_args"] = "sgd", "momentum=0.9"
        elif plan.optimizer in _OPTIM_OUT:
            out["optim"] = _OPTIM_OUT[plan.optimizer]
            if plan.optimizer in EMBED32:
                notes.append(embed32_note(plan.optimizer, f"optim={out['optim']!r}"))
        elif plan.optimizer == "adam":
            out["optim"] = "adamw_torch"
            notes.append(
                "optimizer 'adam': the Trainer has no Adam; wrote optim='adamw_torch' (AdamW with the Trainer's "
                "default weight_decay=0 is Adam, same state bytes; reads back as 'adamw')"
            )
        else:
            notes.append(
                f"optimizer {show(plan.optimizer)}: no Trainer optim runs it; not written (set optim yourself)"
            )
        if plan.optimizer == "adamw_foreach":
            notes.append("optimizer 'adamw_foreach': written as optim='adamw_torch' (torch picks foreach)")
    spec = parallel if parallel is not None else plan.parallel
    fsdp_ckpt = spec is not None and spec.strategy == "fsdp"
    full_n, more = every_n_of(plan, model, RegionKind.FULL)
    notes += more
    off_n, more = every_n_of(plan, model, RegionKind.OFFLOAD)
    notes += more
    inputs_n, more = every_n_of(plan, model, RegionKind.FULL_OFFLOAD)  # checkpoint + kept inputs on the host
    notes += more
    if off_n is not None:  # every saved tensor to the host, no checkpoint: the Trainer has no switch for it
        notes.append(
            "offload regions: the Trainer cannot offload without checkpointing (its offload=True checkpoints each "
            "layer inside save_on_cpu: full_offload); not written"
        )
    off_n = inputs_n  # the Trainer's offload=True is save_on_cpu around each checkpoint: those inputs
    if full_n is not None and off_n is not None:
        notes.append(
            "full and offload regions together: the Trainer has one checkpointing switch; wrote the full regions"
        )
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
        notes.append(
            "selective (per-op) checkpointing: not a Trainer argument (all layers or none); "
            "apply the plan's regions to the model in your script, or use axolotl's selective_checkpointing"
        )
    if spec is not None:
        out.update(_fsdp_fields(spec, fsdp_ckpt, model, notes))
    notes += unwritable(plan, seq_field)
    return out


def _fsdp_fields(spec: ParallelSpec, ckpt: bool, model: nn.Module | None, notes: list[str]) -> dict[str, Any]:
    if spec.strategy == "ddp":
        notes.append(
            f"DDP x{spec.world_size}: no Trainer argument; launch {spec.world_size} processes (torchrun/accelerate)"
        )
        return {}
    cfg: dict[str, Any] = {"version": 2, "reshard_after_forward": spec.reshard_after_forward}
    if spec.cpu_offload:
        cfg["cpu_offload"] = True
    if ckpt:
        cfg["activation_checkpointing"] = True
    classes = wrap_classes(spec, model, notes)
    root_note(spec, notes)
    if classes:
        cfg["transformer_layer_cls_to_wrap"] = classes
    if spec.replicate > 1:
        notes.append(f"HSDP replicate={spec.replicate}: not a Trainer FSDP2 argument; sized for it, written as FSDP2")
    if spec.param_dtype or spec.reduce_dtype:
        notes.append("FSDP mixed-precision dtypes: follow bf16/fp16, not written separately")
    notes.append(
        f"world size {spec.world_size}: launch that many processes (torchrun/accelerate); not a Trainer argument"
    )
    return {"fsdp": True, "fsdp_config": cfg}


def write(plan: Plan, parallel: ParallelSpec | None = None, model: nn.Module | None = None) -> Exported:
    """A plan -> ``TrainingArguments`` fields as JSON (``TrainingArguments(**json.loads(text))``)."""
    notes: list[str] = []
    out = write_fields(plan, parallel, model, notes)
    if plan.loss == "hf_smooth":
        out["label_smoothing_factor"] = 0.1
        notes.append("label smoothing: wrote label_smoothing_factor=0.1 (any factor above 0 allocates the same)")
    elif plan.loss in TRL_LOSSES:
        notes.append(f"loss {plan.loss!r} is TRL's fused LM head: not a TrainingArguments field (export 'trl')")
    if plan.loss == "chunked":
        notes.append(
            "chunked loss: not a TrainingArguments field (the Trainer computes the model's own loss over the "
            "full logits); TRL's SFTTrainer chunks it (export 'trl'), or call memsave_nb.loss.use_chunked_loss(model)"
        )
    return Exported(dump(out, "json"), out, tuple(notes))
