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

from memsave_nb.checkpointing import RegionKind, RegionPolicy, show, suggest_regions
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from .safe_read import TrainerConfigError, check_bounds, parse_text, read_file

__all__ = [
    "Imported",
    "Exported",
    "TrainerConfigError",
    "load_config",
    "checkpoint_layers",
    "regions_for",
    "every_n_of",
    "parallel_of",
    "dump",
    "unwritable",
    "truthy",
    "whole",
    "real",
    "name_of",
    "table",
]


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
    ``SFTConfig``), an object with ``to_dict()``, JSON or YAML text, or a path to a .json/.yaml file.
    Files and text are read within :mod:`.safe_read`'s bounds; every result is walked against them."""
    if isinstance(config, Mapping):
        d = dict(config)
    elif isinstance(config, os.PathLike) or (
        isinstance(config, str) and "\n" not in config and config.strip().endswith((".json", ".yaml", ".yml"))
    ):
        d = read_file(config)
    elif isinstance(config, str):
        d = parse_text(config, "text")
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        # the object's own attributes (after its __post_init__), not to_dict()'s JSON-safe rewrite
        d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if hasattr(config, f.name)}
    elif hasattr(config, "to_dict"):
        d = dict(config.to_dict())
    else:
        raise TrainerConfigError(
            f"a trainer config must be a dict, an arguments object, JSON/YAML text or a path, got {show(config)}"
        )
    check_bounds(d, "trainer config")
    bad = [k for k in d if not isinstance(k, str)]
    if bad:
        raise TrainerConfigError(f"trainer config field names must be strings, got {show(bad[0])}")
    return d


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
    names = [
        n for n, m in model.named_modules() if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
    ]
    return names or list(suggest_regions(model))


def regions_for(
    model: nn.Module | None, kind: RegionKind, every_n: int = 1
) -> tuple[dict[str, RegionPolicy], list[str]]:
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
    what = (
        f"regions {', '.join(outside)} are not layers the trainer counts"
        if outside
        else f"{len(chosen)} chosen layers are not every n-th one"
    )
    return n, [
        f"{kind.value} checkpointing: the trainer checkpoints every n-th layer only; {what}: "
        f"wrote every_n_layers={n}, which checkpoints {len(range(0, len(layers), n))} of {len(layers)} layers"
    ]


def parallel_of(
    fsdp: Mapping[str, Any], world_size: int | None, model: nn.Module | None, notes: list[str]
) -> ParallelSpec:
    """A ``ParallelSpec`` from normalised FSDP settings (``version``, ``cpu_offload``,
    ``reshard_after_forward``, ``transformer_layer_cls_to_wrap``)."""
    version = whole(fsdp, "version", 2, 1, 2)
    if version != 2:
        notes.append(f"FSDP version {version}: sized as FSDP2 (fully_shard), the only FSDP the project measures")
    if world_size is None:
        world_size = ParallelSpec.world_size
        notes.append(f"world size is the launcher's, not the config's: sized for {world_size} ranks (pass world_size=)")
    reshard = fsdp.get("reshard_after_forward", True)
    if isinstance(reshard, str) and reshard.strip().upper() in _STRATEGIES:  # accelerate's FSDP1 names
        reshard = reshard.strip().upper() in ("FULL_SHARD", "HYBRID_SHARD")
    reshard = truthy(reshard, "reshard_after_forward")
    shard: tuple[str, ...] = ()
    classes = fsdp.get("transformer_layer_cls_to_wrap") or ()
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",")]
    if not isinstance(classes, (list, tuple)) or not all(isinstance(c, str) for c in classes):
        raise TrainerConfigError(f"transformer_layer_cls_to_wrap: must be class names, got {show(classes)}")
    if classes and model is not None:
        shard = tuple(n for n, m in model.named_modules() if type(m).__name__ in set(classes))
        if not shard:
            notes.append(
                f"transformer_layer_cls_to_wrap {list(classes)}: no such module in the model; shards the repeated blocks"
            )
    elif classes:
        notes.append("transformer_layer_cls_to_wrap: pass model= to name those modules; shards the repeated blocks")
    # accelerate's FSDP2 plugin passes reshard_after_forward to the root too (torch's own default keeps it)
    return ParallelSpec(
        world_size=world_size,
        strategy="fsdp",
        shard_modules=shard,
        reshard_after_forward=reshard,
        reshard_root=bool(reshard),
        cpu_offload=truthy(fsdp.get("cpu_offload", False), "cpu_offload"),
    )


def root_note(spec: ParallelSpec, notes: list[str]) -> None:
    """Accelerate reshards the FSDP2 root as it does the units; say so where the spec differs."""
    if spec.strategy == "fsdp" and spec.reshard_root != spec.reshard_after_forward:
        kept = "kept gathered after forward (torch's default)" if not spec.reshard_root else "resharded after forward"
        notes.append(
            f"FSDP2 root {kept} as sized; accelerate applies reshard_after_forward="
            f"{spec.reshard_after_forward} to the root too, so the trainer's per-rank peak differs"
        )


_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def truthy(value: Any, key: str = "a switch") -> bool:
    """A yes/no field: a bool, None (no), or the text/number forms YAML and launchers write
    (``"true"``/``"false"``, 1/0); anything else is refused, never read by Python's truthiness."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _YES + _NO:
        return value.strip().lower() in _YES
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise TrainerConfigError(f"{key}: must be true or false, got {show(value)}")


_YES, _NO = ("true", "1", "yes"), ("false", "0", "no")
MAX_COUNT = 1 << 24  # batch sizes, steps, lengths, ranks: above this no config is a real one


def whole(d: Mapping[str, Any], key: str, default: Any = None, lo: int = 1, hi: int = MAX_COUNT) -> Any:
    """``d[key]`` (``default`` when missing or None) as a whole number in ``[lo, hi]``: no bool,
    no fraction (2.5 is not 2), no text; the trainer itself would fail or differ on those."""
    value = d.get(key)
    if value is None:
        value = default
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise TrainerConfigError(f"{key}: must be a whole number from {lo} to {hi}, got {show(value)}")
    return value


def real(d: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    """``d[key]`` as a finite number in ``[lo, hi)`` (default when missing or None)."""
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < hi:
        raise TrainerConfigError(f"{key}: must be a number from {lo} to below {hi}, got {show(value)}")
    return float(value)


def name_of(d: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``d[key]`` as text (an enum's ``.value`` too); ``default`` when missing or None."""
    value = d.get(key)
    if value is None:
        return default
    value = getattr(value, "value", value)
    if not isinstance(value, str) or len(value) > 100:
        raise TrainerConfigError(f"{key}: must be a name, got {show(value)}")
    return value


def table(d: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``d[key]`` as a dict of settings ({} when missing or None); JSON text is read too, as the Trainer does."""
    value = d.get(key)
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        value = parse_text(value, key)
    if not isinstance(value, Mapping):
        raise TrainerConfigError(f"{key}: must be a mapping of settings, got {show(value)}")
    return dict(value)


def unwritable(plan: Plan, seq_field: bool = False) -> list[str]:
    """Plan choices no trainer config holds (the model is the user's to change)."""
    notes = []
    if plan.frozen or plan.trainable:
        notes.append(
            "frozen/trainable parameters: set requires_grad in your script before building the trainer "
            "(it trains what requires grad)"
        )
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
    notes.append(
        "FSDP units by module name: trainers wrap by class (transformer_layer_cls_to_wrap); these units are "
        "not all modules of some classes (or no model= was given), so the trainer's default wrapping is written"
    )
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
    assert cfg is not None  # it has a LoRA peft_type
    targets = cfg.target_modules
    return {
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": targets if isinstance(targets, str) else sorted(targets or ()),
    }
