"""Which fields a trainer's arguments class takes, read from the installed package (issue 41).

``TrainingArguments(per_device_train_batch_sise=64)`` raises ``TypeError``; so does a dict of
fields with a misspelt or retired name (TRL's old ``max_seq_length``). Reading such a dict as if
the name were absent sizes the default batch, silently. Here a name the class does not take is
refused (with the closest real name), and the fields it takes that set something the plan does
not size are named in one note. Without the package installed, nothing is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any, Mapping

from memsave_nb.checkpointing import show

from .safe_read import TrainerConfigError

__all__ = ["SIZED", "class_fields", "check_fields"]

# the fields whose values the readers turn into the plan (hf.read_fields, hf.read, trl.read)
SIZED = frozenset(
    {
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "optim",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "fsdp",
        "fsdp_config",
        "label_smoothing_factor",
        "torch_compile",
        "use_liger_kernel",
        "deepspeed",
        "optim_args",
        "max_length",
        "activation_offloading",
        "loss_type",
        "packing",
        "padding_free",
        "use_cpu",
    }
)  # use_cpu: TRL's head runs its CPU path (trl.py)


@functools.lru_cache(maxsize=None)
def class_fields(trainer: str) -> tuple[frozenset[str], dict[str, Any]] | None:
    """(field names, their defaults) of ``TrainingArguments`` (``"hf"``) or ``SFTConfig``
    (``"trl"``) as installed; None when the package is missing."""
    try:
        if trainer == "trl":
            from trl import SFTConfig as cls
        else:
            from transformers import TrainingArguments as cls  # type: ignore[assignment]
    except ImportError:
        return None
    fields = [f for f in dataclasses.fields(cls) if f.init]
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    return frozenset(f.name for f in fields), defaults


def check_fields(config: Any, d: Mapping[str, Any], trainer: str, notes: list[str]) -> None:
    """Refuse a field the arguments class would refuse; note, once, the set fields not sized.
    An arguments object built by the class itself is checked by its class already."""
    known = class_fields(trainer)
    if known is None or (dataclasses.is_dataclass(config) and not isinstance(config, type)):
        return
    names, defaults = known
    unknown = [k for k in d if k not in names]
    if unknown:
        near = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        cls = "SFTConfig" if trainer == "trl" else "TrainingArguments"
        raise TrainerConfigError(f"{show(unknown[0], 50)}: not a field of {cls}, which refuses it{hint}")
    unsized = sorted(
        k for k, v in d.items() if k not in SIZED and k != "output_dir" and not _same(v, defaults.get(k, v))
    )
    if unsized:
        more = f" and {len(unsized) - 6} more" if len(unsized) > 6 else ""
        notes.append(f"fields set but not sized (they do not change the plan): {', '.join(unsized[:6])}{more}")


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default) or str(getattr(value, "value", value)) == str(getattr(default, "value", default))
    except Exception:  # noqa: BLE001 - a value whose == raises is not the default
        return False
