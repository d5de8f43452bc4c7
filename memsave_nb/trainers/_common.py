"""What every trainer module shares: reading a config in any form, the result types, and the
model's checkpointable layers (the only names a trainer's all-layers switches can mean).

Each trainer module is a pair of pure functions, ``read(config, model=None, world_size=None)``
-> :class:`Imported` and ``write(plan, parallel=None, model=None)`` -> :class:`Exported`; what a
config holds that a plan cannot size, or a plan holds that a config cannot say, becomes one line
in ``notes``, never a silent drop.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, NamedTuple

from torch import nn

from memsave_nb.checkpointing import PlanError, RegionKind, RegionPolicy, show, suggest_regions
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

__all__ = ["Imported", "Exported", "TrainerConfigError", "load_config", "checkpoint_layers", "regions_for",
           "every_n_of", "parallel_of", "root_note", "dump", "unwritable", "truthy"]


class TrainerConfigError(PlanError):
    """A trainer config that cannot be read (bad file, bad type, conflicting fields)."""


class Imported(NamedTuple):
    """A trainer config as a plan: ``plan`` (its ``parallel`` field set too), the ``parallel``
    spec (``None`` on one device), and ``notes``: what the config holds that the plan does not size."""

    plan: Plan
    parallel: ParallelSpec | None
    notes: tuple[str, ...]


class Exported(NamedTuple):
    """A plan as a trainer's config: ``text`` (JSON or YAML, the trainer's own field names),
    ``fields`` (the same as a dict) and ``notes``: what the plan holds that the config cannot say."""

    text: str
    fields: dict[str, Any]
    notes: tuple[str, ...]


def load_config(config: Any) -> dict[str, Any]:
    """A config as a plain dict: a mapping, a dataclass object (``TrainingArguments``,
    ``SFTConfig``), an object with ``to_dict()``, JSON or YAML text, or a path to a .json/.yaml file."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, os.PathLike) or (isinstance(config, str) and "\n" not in config and
                                           config.strip().endswith((".json", ".yaml", ".yml"))):
        try:
            with open(config, encoding="utf-8") as f:
                return _parse_text(f.read(), str(config))
        except OSError as exc:
            raise TrainerConfigError(f"cannot read trainer config {show(str(config))}: {exc.strerror}") from None
    if isinstance(config, str):
        return _parse_text(config, "text")
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        # the object's own attributes (after its __post_init__), not to_dict()'s JSON-safe rewrite
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if hasattr(config, f.name)}
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise TrainerConfigError(f"a trainer config must be a dict, an arguments object, JSON/YAML text or a path, got {show(config)}")


def _parse_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TrainerConfigError(f"trainer config {where} is neither JSON nor YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise TrainerConfigError(f"trainer config {where} must hold an object of fields, got {show(data)}")
    return data


def dump(fields: Mapping[str, Any], fmt: str) -> str:
    """The config text: ``"json"`` (Hugging Face's ``TrainingArguments(**json.load(f))``) or ``"yaml"``."""
    if fmt == "json":
        return json.dumps(dict(fields), indent=2) + "\n"
    import yaml

    return yaml.safe_dump(dict(fields), sort_keys=False)


# -- the layers a trainer's all-layers switch checkpoints ---------------------------------------------


def checkpoint_layers(model: nn.Module) -> list[str]:
    """Names of the repeated blocks, in order: Hugging Face's ``GradientCheckpointingLayer``
    modules (what ``activation_checkpointing_enable`` counts), else the project's suggestion."""
    names = [n for n, m in model.named_modules()
             if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    return names or list(suggest_regions(model))


def regions_for(model: nn.Module | None, kind: RegionKind, every_n: int = 1) -> tuple[dict[str, RegionPolicy], list[str]]:
    """Regions of ``kind`` on every ``every_n``-th checkpoint layer (index % n == 0, as
    transformers picks them), and a note when there is no model to name them."""
    if model is None:
        return {}, [f"{kind.value} regions on every layer: pass model= to name the layers; the plan has none"]
    layers = checkpoint_layers(model)
    if not layers:
        return {}, [f"{kind.value} regions: the model has no repeated blocks to put them on"]
    return {name: RegionPolicy(kind) for i, name in enumerate(layers) if i % every_n == 0}, []


def every_n_of(plan: Plan, model: nn.Module | None, kind: RegionKind) -> tuple[int | None, list[str]]:
    """The ``every_n_layers`` that gives exactly the plan's regions of ``kind``: 1 for all layers,
    n for layers 0, n, 2n...; ``None`` when no region has that kind. When no n fits, the smallest n
    that covers every chosen layer (more checkpointing, never less) and a note saying so."""
    chosen = {n for n, p in plan.regions.items() if p.kind is kind}
    if not chosen:
        return None, []
    layers = checkpoint_layers(model) if model is not None else sorted(chosen)
    if model is None:
        return 1, [f"{kind.value} regions written as every layer: pass model= to check they are all of them"]
    for n in range(len(layers), 0, -1):
        if {name for i, name in enumerate(layers) if i % n == 0} == chosen:
            return n, []
    indices = sorted(layers.index(c) for c in chosen if c in layers)
    n = 1
    for cand in range(len(layers), 0, -1):
        if all(i % cand == 0 for i in indices):
            n = cand
            break
    outside = sorted(chosen - set(layers))
    what = f"regions {', '.join(outside)} are not layers the trainer counts" if outside else \
        f"{len(chosen)} chosen layers are not every n-th one"
    return n, [f"{kind.value} checkpointing: the trainer checkpoints every n-th layer only; {what}: "
               f"wrote every_n_layers={n}, which checkpoints {len(range(0, len(layers), n))} of {len(layers)} layers"]


def parallel_of(fsdp: Mapping[str, Any], world_size: int | None, model: nn.Module | None,
                notes: list[str]) -> ParallelSpec:
    """A ``ParallelSpec`` from normalised FSDP settings (``version``, ``cpu_offload``,
    ``reshard_after_forward``, ``transformer_layer_cls_to_wrap``)."""
    version = int(fsdp.get("version", 2))
    if version != 2:
        notes.append(f"FSDP version {version}: sized as FSDP2 (fully_shard), the only FSDP the project measures")
    if world_size is None:
        world_size = ParallelSpec.world_size
        notes.append(f"world size is the launcher's, not the config's: sized for {world_size} ranks (pass world_size=)")
    reshard = fsdp.get("reshard_after_forward", True)
    if isinstance(reshard, str):
        reshard = reshard.lower() in ("true", "1", "full_shard", "hybrid_shard")
    shard: tuple[str, ...] = ()
    classes = fsdp.get("transformer_layer_cls_to_wrap") or ()
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",")]
    if classes and model is not None:
        shard = tuple(n for n, m in model.named_modules() if type(m).__name__ in set(classes))
        if not shard:
            notes.append(f"transformer_layer_cls_to_wrap {list(classes)}: no such module in the model; shards the repeated blocks")
    elif classes:
        notes.append("transformer_layer_cls_to_wrap: pass model= to name those modules; shards the repeated blocks")
    # accelerate's FSDP2 plugin passes reshard_after_forward to the root too (torch's own default keeps it)
    return ParallelSpec(world_size=int(world_size), strategy="fsdp", shard_modules=shard,
                        reshard_after_forward=bool(reshard), reshard_root=bool(reshard),
                        cpu_offload=truthy(fsdp.get("cpu_offload", False)))


def root_note(spec: ParallelSpec, notes: list[str]) -> None:
    """Accelerate reshards the FSDP2 root as it does the units; say so where the spec differs."""
    if spec.strategy == "fsdp" and spec.reshard_root != spec.reshard_after_forward:
        kept = "kept gathered after forward (torch's default)" if not spec.reshard_root else "resharded after forward"
        notes.append(f"FSDP2 root {kept} as sized; accelerate applies reshard_after_forward="
                     f"{spec.reshard_after_forward} to the root too, so the trainer's per-rank peak differs")


def truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def unwritable(plan: Plan, seq_field: bool = False) -> list[str]:
    """Plan choices no trainer config holds (the model is the user's to change)."""
    notes = []
    if plan.frozen or plan.trainable:
        notes.append("frozen/trainable parameters: set requires_grad in your script before building the trainer "
                     "(it trains what requires grad)")
    if plan.memsave:
        notes.append("memory-saving layers: apply memsave_nb.convert(model) before building the trainer")
    if plan.compile_budget is not None:
        notes.append(f"compile budget {plan.compile_budget}: not a trainer argument (torchtitan's MemoryBudgetAC is)")
    if plan.bn_eval:
        notes.append("batch-norm layers in eval mode: set them in your script")
    if plan.seq_len is not None and not seq_field:
        notes.append(f"sequence length {plan.seq_len}: set by your data (truncate to it)")
    if plan.set_to_none is False:
        notes.append("zero_grad(set_to_none=False): the Trainer always sets gradients to None")
    return notes


def wrap_classes(spec: ParallelSpec, model: nn.Module | None, notes: list[str]) -> list[str]:
    """``transformer_layer_cls_to_wrap`` for the spec's FSDP units: their class names, when the
    modules of those classes are exactly the units; else [] (the trainer's default wrapping) and a note."""
    if not spec.shard_modules:
        return []
    if model is not None:
        modules = dict(model.named_modules())
        classes = sorted({type(modules[n]).__name__ for n in spec.shard_modules if n in modules})
        picked = tuple(n for n, m in model.named_modules() if type(m).__name__ in classes)
        if picked == spec.shard_modules:
            return classes
    notes.append("FSDP units by module name: trainers wrap by class (transformer_layer_cls_to_wrap); these units are "
                 "not all modules of some classes (or no model= was given), so the trainer's default wrapping is written")
    return []


def lora_of(model: nn.Module | None) -> dict[str, Any] | None:
    """The LoRA settings of a peft model (``model.peft_config``'s active adapter) as plain data:
    ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` (sorted list or regex string);
    ``None`` when the model is not a LoRA peft model. Nothing here imports peft."""
    configs = getattr(model, "peft_config", None) if model is not None else None
    if not isinstance(configs, Mapping) or not configs:
        return None
    name = getattr(model, "active_adapter", None)
    cfg = configs.get(name) if isinstance(name, str) and name in configs else next(iter(configs.values()))
    if str(getattr(cfg, "peft_type", "")).split(".")[-1].upper() != "LORA":
        return None
    targets = cfg.target_modules
    return {"r": cfg.r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets or ())}
