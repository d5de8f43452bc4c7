"""TRL ``SFTConfig`` <-> a Plan (trl 1.16's ``sft_config.py``, ``base_config.py``, ``sft_trainer.py``).

``SFTConfig`` is ``TrainingArguments`` (see :mod:`.hf`) with other defaults
(``gradient_checkpointing=True``, ``bf16=True`` unless ``fp16``) plus ``max_length`` (-> the plan's
``seq_len``: TRL truncates to it; shorter data stays shorter) and ``activation_offloading`` (trl
1.16 ``models/activation_offloading.py``: a ``saved_tensors_hooks`` around the whole forward moves
every saved tensor of 1024 bytes or more, parameters and the LM head's excepted, to the host).
Without checkpointing it is sized as offload regions on every layer; with checkpointing (SFTConfig's
default) the checkpoint's inputs are the only tensors a layer saves through those hooks, so each
checkpointed layer becomes a ``full_offload`` region (its kept inputs on the host).
The loss (trl 1.16, ``SFTTrainer.compute_loss`` and ``trainer/utils.py``'s ``add_fused_lm_head``):
``loss_type='nll'`` (the default) and ``'dft'`` both run the backbone and then a fused LM head that
projects tiles of 4096 tokens x 32768 vocabulary entries, never the ``batch x seq x vocab`` logits;
``'chunked_nll'`` is a deprecated alias that ``SFTConfig.__post_init__`` rewrites to ``'nll'``. So
every ``loss_type`` reads as TRL's head as TRL runs it (:mod:`memsave_nb.loss_trl`): ``loss='trl_cpu'``
with ``use_cpu`` (no Triton), else ``'trl_cuda'``; ``label_smoothing_factor > 0`` as
``'trl_smooth_cpu'``/``'trl_smooth_cuda'`` (full logits through the smoother, then a no-grad fused
pass for the metrics). Export writes ``loss_type='nll'``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from memsave_nb.checkpointing import RegionKind, RegionPolicy, show
from memsave_nb.loss_trl import TRL_LOSSES
from memsave_nb.offload import TRL_MIN_OFFLOAD_BYTES
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from . import hf
from ._common import (
    Exported,
    Imported,
    TrainerConfigError,
    checkpoint_layers,
    dump,
    every_n_of,
    load_config,
    lora_of,
    name_of,
    real,
    regions_for,
    truthy,
    whole,
)
from .fields import check_fields

__all__ = ["DEFAULTS", "read", "write"]

DEFAULTS: dict[str, Any] = {**hf.DEFAULTS, "gradient_checkpointing": True, "max_length": 1024, "loss_type": "nll"}

# TRL's fused LM head tiles (trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE, trainer/utils.py
# _CHUNKED_LOGPROB_CHUNK_SIZE): tokens x vocabulary entries per projection
TILE_TOKENS, TILE_VOCAB = 4096, 32768
LOSS_TYPES = ("nll", "dft", "chunked_nll")


def loss_chunk_for(model: nn.Module | None) -> int | None:
    """Tokens per chunk whose ``chunk x vocab`` logits hold as many elements as one TRL tile
    (``4096 x min(32768, vocab)``); ``None`` without a model whose head says its vocabulary."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    vocab = getattr(head, "out_features", None)
    if not isinstance(vocab, int) or vocab < 1:
        return None
    return max(1, TILE_TOKENS * min(TILE_VOCAB, vocab) // vocab)


def _read_loss(d: dict[str, Any], model: nn.Module | None, notes: list[str]) -> dict[str, Any]:
    loss_type = name_of(d, "loss_type") or DEFAULTS["loss_type"]
    if loss_type not in LOSS_TYPES:
        raise TrainerConfigError(f"loss_type {show(loss_type)}: SFTConfig takes one of {', '.join(LOSS_TYPES)}")
    device = "cpu" if truthy(d.get("use_cpu"), "use_cpu") else "cuda"  # TRL's head runs another path with Triton (CUDA)
    path = "torch folds, every position" if device == "cpu" else "Triton folds, valid positions only"
    smoothing = real(d, "label_smoothing_factor", 0.0, 0.0, 1.0)
    if smoothing > 0:
        notes.append(
            f"label_smoothing_factor={smoothing}: TRL runs the full logits through the label "
            f"smoother, then a no-grad fused pass for its metrics ({path}); sized as loss='trl_smooth_{device}'"
        )
        return {"loss": f"trl_smooth_{device}"}
    alias = " ('chunked_nll' is TRL's deprecated alias of 'nll')" if loss_type == "chunked_nll" else ""
    dft = "; DFT weights each token's loss by its detached probability (same buffers)" if loss_type == "dft" else ""
    notes.append(
        f"loss_type={loss_type!r}{alias}: TRL's fused LM head projects {TILE_TOKENS} tokens x {TILE_VOCAB} vocabulary "
        f"entries at a time ({path}); sized as loss='trl_{device}'{dft}"
    )
    return {"loss": f"trl_{device}"}


def read(config: Any, model: nn.Module | None = None, world_size: int | None = None) -> Imported:
    """``SFTConfig`` (object, dict, JSON/YAML text or path) -> the plan SFTTrainer runs."""
    d = load_config(config)
    notes: list[str] = []
    check_fields(config, d, "trl", notes)
    if d.get("bf16") is None:  # SFTConfig: bf16 unless fp16
        d["bf16"] = not truthy(d.get("fp16"), "fp16")
    kw = hf.read_fields(d, model, world_size, DEFAULTS, notes, trl=True)
    max_length = DEFAULTS["max_length"] if "max_length" not in d else whole(d, "max_length")  # None: no truncation
    if max_length is not None:
        kw["seq_len"] = max_length
        notes.append(f"max_length={max_length}: TRL truncates to it; sized at that length (shorter data is shorter)")
    if truthy(d.get("activation_offloading"), "activation_offloading"):
        if kw.get("regions"):
            kw["regions"] = _offload_inputs(kw["regions"], model, notes)
        else:
            kw["regions"], more = regions_for(model, RegionKind.OFFLOAD)
            notes += more
            notes.append(
                "activation_offloading: TRL offloads every saved tensor of the forward; sized as offload "
                "regions on every layer (the embedding's and head's saved tensors stay on device)"
            )
    kw.update(_read_loss(d, model, notes))
    for key in ("packing", "padding_free"):
        if truthy(d.get(key), key):
            notes.append(f"{key}: sequences are concatenated into batch rows; sized as the workload's batch shape")
    plan = Plan(name="trl", **kw)
    return Imported(plan, plan.parallel, tuple(notes))


def _offload_inputs(
    regions: dict[str, RegionPolicy], model: nn.Module | None, notes: list[str]
) -> dict[str, RegionPolicy]:
    """Checkpointed layers under TRL's offloading: each one's kept inputs go to the host; a layer
    left unchecked (``every_n_layers`` > 1) has every saved tensor moved, as an offload region."""
    full = RegionPolicy(RegionKind.FULL_OFFLOAD)
    out = {k: full if p.kind is RegionKind.FULL else p for k, p in regions.items()}
    bare = [name for name in (checkpoint_layers(model) if model is not None else []) if name not in out]
    out.update({name: RegionPolicy(RegionKind.OFFLOAD) for name in bare})
    other = sorted({p.kind.value for p in regions.values() if p.kind is not RegionKind.FULL})
    notes.append(
        "activation_offloading with checkpointing: TRL moves what the checkpointed layers keep (their inputs, "
        f"{TRL_MIN_OFFLOAD_BYTES} bytes or more) to the host; sized as 'full_offload' regions (the final norm's "
        "and the loss's saved tensors, which TRL also moves, stay on device)"
        + (f"; the {len(bare)} layers not checkpointed as offload regions" if bare else "")
        + (f"; {', '.join(other)} regions sized as they are" if other else "")
    )
    return out


def write(plan: Plan, parallel: ParallelSpec | None = None, model: nn.Module | None = None) -> Exported:
    """A plan -> ``SFTConfig`` fields as JSON (``SFTConfig(**json.loads(text))``). SFTConfig's own
    defaults differ from TrainingArguments', so checkpointing and bf16 are always written."""
    notes: list[str] = []
    inputs_offloaded = any(p.kind is RegionKind.FULL_OFFLOAD for p in plan.regions.values())
    if inputs_offloaded:  # TRL's switch with its checkpointing: written as full regions + activation_offloading
        if any(p.kind is RegionKind.FULL for p in plan.regions.values()):
            notes.append(
                "full and full_offload regions together: TRL's activation_offloading is one switch; "
                "wrote it on (every checkpointed layer's inputs go to the host)"
            )
        regions = {  # TRL's switch moves the other layers' saved tensors too: offload regions are implied
            k: RegionPolicy.full() if p.kind is RegionKind.FULL_OFFLOAD else p
            for k, p in plan.regions.items()
            if p.kind is not RegionKind.OFFLOAD
        }
        plan = Plan(**{**_plan_kwargs(plan), "regions": regions})
    offload_only = every_n_of(plan, model, RegionKind.OFFLOAD)[0] == 1 and not any(
        p.kind is RegionKind.FULL for p in plan.regions.values()
    )
    if offload_only:  # TRL's own switch for offloading activations
        plan = Plan(
            **{
                **_plan_kwargs(plan),
                "regions": {k: v for k, v in plan.regions.items() if v.kind is not RegionKind.OFFLOAD},
            }
        )
    out = hf.write_fields(plan, parallel, model, notes, seq_field=True)
    # transformers 5.25's names (gradient_checkpointing* are deprecated aliases it warns about);
    # SFTConfig defaults checkpointing to True, so it is always said
    kwargs = out.pop("activation_checkpointing_kwargs", None)
    out["activation_checkpointing"] = bool(out.pop("activation_checkpointing", False))
    if kwargs:
        out["activation_checkpointing_kwargs"] = kwargs
    if out.get("fsdp_config", {}).get("activation_checkpointing"):
        out["activation_checkpointing"] = False
    if "bf16" not in out:
        out["bf16"], out["fp16"] = True, False
        notes.append("precision not set: wrote SFTConfig's default bf16=True")
    if plan.seq_len is not None:
        out["max_length"] = plan.seq_len
    else:
        notes.append(
            f"sequence length not in the plan: SFTConfig's default max_length={DEFAULTS['max_length']} truncates"
        )
    if inputs_offloaded:
        out["activation_offloading"] = True
        notes.append("full_offload regions: wrote activation_offloading=True with checkpointing on")
    if offload_only:
        out["activation_offloading"] = True
        notes.append(
            "offload regions on every layer: wrote activation_offloading=True (TRL offloads every saved "
            "tensor of the forward, a little more than the layers')"
        )
    out["loss_type"] = "nll"  # TRL 1.16's name for its chunked loss (also SFTConfig's default)
    if plan.loss in TRL_LOSSES:  # TRL's own head, as TRL runs it on the device the plan names
        if plan.loss.endswith("cpu"):
            out["use_cpu"] = True
        if "smooth" in plan.loss:
            out["label_smoothing_factor"] = 0.1
            notes.append("label smoothing: wrote label_smoothing_factor=0.1 (any factor above 0 runs the same buffers)")
    else:
        notes.append(
            f"loss {plan.loss or 'as the workload computes it'}: TRL always computes the loss through its own "
            "fused LM head; wrote loss_type='nll' (loss='trl_cuda', or 'trl_cpu' on the CPU, sizes it)"
        )
    lora = lora_of(model)
    if lora is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in lora.items())
        notes.append(
            f"LoRA is not an SFTConfig field: pass the peft model, or SFTTrainer(..., peft_config=LoraConfig({args}))"
        )
    return Exported(dump(out, "json"), out, tuple(notes))


def _plan_kwargs(plan: Plan) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
