"""From the trainer you use and back: a trainer's config as a Plan, and a Plan as its config.

One module per trainer, each a pair of pure functions (``read`` / ``write``): :mod:`.hf`
(``TrainingArguments``), :mod:`.trl` (``SFTConfig``), :mod:`.axolotl` (YAML), :mod:`.accelerate`
(config YAML). Nothing is applied or measured here: apply the imported plan to your workload and
measure it (``with imported.plan.apply(workload) as w: measure(w)``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn

from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan

from . import accelerate, axolotl, hf, trl
from ._common import Exported, Imported, TrainerConfigError, load_config, lora_of

__all__ = [
    "TRAINERS",
    "from_trainer",
    "to_trainer",
    "detect",
    "lora_settings",
    "Imported",
    "Exported",
    "TrainerConfigError",
]

TRAINERS: dict[str, ModuleType] = {"hf": hf, "trl": trl, "axolotl": axolotl, "accelerate": accelerate}

# keys of axolotl's YAML that neither TrainingArguments, SFTConfig (with TRL's ModelConfig: lora_r,
# load_in_4bit) nor an accelerate config has: a config holding none of the batch fields is still axolotl's
_AXOLOTL_ONLY = (
    "base_model",
    "base_model_config",
    "tokenizer_type",
    "datasets",
    "dataset_prepared_path",
    "val_set_size",
    "adapter",
    "lora_model_dir",
    "lora_target_linear",
    "micro_batch_size",
    "sequence_len",
    "sample_packing",
    "pad_to_sequence_len",
    "num_epochs",
    "train_on_inputs",
    "unfrozen_parameters",
    "flash_attention",
    "xformers_attention",
    "sdp_attention",
    "wandb_project",
    "evals_per_epoch",
    "saves_per_epoch",
)
_TRL_ONLY = ("max_length", "loss_type", "activation_offloading", "packing", "padding_free", "dataset_text_field")


def detect(config: Any) -> str:
    """Which trainer a config is for: by the object's class, else by its fields."""
    cls = type(config).__name__
    if cls.endswith("SFTConfig") or cls.endswith("Config") and type(config).__module__.startswith("trl"):
        return "trl"
    if cls.endswith("TrainingArguments"):
        return "hf"
    d = load_config(config)
    if any(k in d for k in _AXOLOTL_ONLY) or d.get("gradient_checkpointing") == "offload":
        return "axolotl"
    if "distributed_type" in d or ("mixed_precision" in d and "per_device_train_batch_size" not in d):
        return "accelerate"
    if any(k in d for k in _TRL_ONLY):
        return "trl"
    return "hf"


def from_trainer(
    config: Any, model: nn.Module | None = None, *, trainer: str | None = None, world_size: int | None = None
) -> Imported:
    """A trainer config (object, dict, JSON/YAML text or path) -> ``Imported(plan, parallel, notes)``:
    the plan the trainer would run on ``model`` (its layers name the checkpointed regions), and
    one line per choice the plan does not size. ``trainer``: ``"hf"|"trl"|"axolotl"|"accelerate"``
    (default: detected); ``world_size``: ranks, which the launcher (not the config) decides."""
    name = trainer or detect(config)
    return _module(name).read(config, model=model, world_size=world_size)


def to_trainer(
    plan: Plan, trainer: str, *, parallel: ParallelSpec | None = None, model: nn.Module | None = None
) -> Exported:
    """A plan -> ``Exported(text, fields, notes)``: ``trainer``'s own config for every choice it can
    express, and one line for each it cannot. Pass ``model`` to check region choices against the
    layers the trainer counts."""
    if not isinstance(plan, Plan):
        raise TrainerConfigError(f"to_trainer takes a Plan, got {type(plan).__name__}")
    return _module(trainer).write(plan, parallel=parallel, model=model)


def lora_settings(model: nn.Module | None) -> dict[str, Any] | None:
    """A peft model's LoRA settings as ``LoraConfig`` keyword arguments (``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``), to pass beside the exported config
    (``SFTTrainer(..., peft_config=LoraConfig(**lora_settings(model)))``); ``None`` for a model
    without LoRA adapters."""
    return lora_of(model)


def _module(name: str) -> ModuleType:
    if name not in TRAINERS:
        raise TrainerConfigError(f"unknown trainer {name!r}: choose one of {sorted(TRAINERS)}")
    return TRAINERS[name]
