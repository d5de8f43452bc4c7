"""LoRA from plain values: a peft ``LoraConfig``, a short dict, or a command-line string.

``parse_lora("r=16,alpha=32,target_modules=q_proj+v_proj")`` gives the short dict; ``lora_config``
turns any of the three into a ``LoraConfig``; ``apply_lora`` wraps the model with peft, which freezes
the base exactly as it does in a training script.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import sys
import warnings
from typing import Any

from torch import nn

from .configs import HubError, reason, short

_ALIASES = {
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target": "target_modules",
    "targets": "target_modules",
    "save": "modules_to_save",
    "rank": "r",
}
_LIST_KEYS = ("target_modules", "modules_to_save")
_PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "seq-classification": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}
MAX_RANK = 2**16  # above any model's width: a larger rank is a typo, and its adapters would not fit anywhere
_INT = re.compile(r"[+-]?[0-9]{1,18}")  # ASCII digits only ("²".isdigit() is True), and short enough for int()
_FLOAT = re.compile(r"[+-]?([0-9]{1,18}\.?[0-9]{0,18}|\.[0-9]{1,18})([eE][+-]?[0-9]{1,3})?")


def parse_lora(text: str) -> dict[str, Any]:
    """``"r=16,alpha=32,target_modules=q_proj+v_proj"`` -> ``{"r": 16, "alpha": 32, "target_modules": [...]}``.

    A bare number is the rank (``"16"``); lists are joined with ``+``; ``all-linear`` is peft's own word."""
    text = text.strip()
    if _INT.fullmatch(text):
        return {"r": int(text)}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not sep or not value.strip() or not key.isidentifier():
            raise HubError(
                f"cannot read LoRA setting {short(part, 40)}: write key=value, "
                "e.g. 'r=16,alpha=32,target_modules=q_proj+v_proj'"
            )
        value = value.strip()
        if _ALIASES.get(key, key) in _LIST_KEYS:
            out[key] = value if value == "all-linear" else [v for v in value.split("+") if v]
        elif _INT.fullmatch(value):
            out[key] = int(value)
        elif _FLOAT.fullmatch(value):
            out[key] = float(value)
        else:
            out[key] = value
    return out


def _number(kwargs: dict[str, Any], key: str, low: float, high: float, whole: bool = False) -> None:
    """``kwargs[key]`` (when given) a finite number in ``[low, high]``; a whole one if ``whole``."""
    if key not in kwargs:
        return
    value = kwargs[key]
    ok = isinstance(value, int) if whole else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or not low <= value <= high:
        kind = "a whole number" if whole else "a number"
        raise HubError(f"LoRA {key} must be {kind} from {low:g} to {high:g}, got {short(value, 40)}")


def _names(kwargs: dict[str, Any], key: str) -> None:
    """``kwargs[key]`` (when given) a module name, a regex, ``"all-linear"`` or a list of names."""
    value = kwargs.get(key)
    if value is None or (isinstance(value, str) and 0 < len(value) <= 1000):
        return
    if (
        isinstance(value, (list, tuple, set))
        and len(value) <= 1000
        and all(isinstance(v, str) and 0 < len(v) <= 200 for v in value)
    ):
        kwargs[key] = list(value)
        return
    raise HubError(
        f"LoRA {key} must be module names (a list of strings, a regex or 'all-linear'), got {short(value, 40)}"
    )


@contextlib.contextmanager
def _quiet_peft():
    """peft imports bitsandbytes (at import and when it wraps a model), and bitsandbytes logs a
    warning on import on CPUs with AVX512-BF16 (its optional ``kernels`` download fails offline);
    peft reads transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning). Both are
    noise above our answer: bitsandbytes' loggers are raised to ERROR and that one warning is
    ignored, for the call only."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def without_bitsandbytes():
    """Inside, ``import bitsandbytes`` fails, so peft wraps a model without importing it: 1-2 s
    saved (bitsandbytes imports torch's compiler). For a one-shot process that never hands peft a
    bitsandbytes layer (the command line; our QLoRA is a stand-in, :mod:`.quant`): peft then keeps
    "no bitsandbytes" for the rest of the process. A later ``import bitsandbytes`` (the 8-bit
    optimizer) still works. Does nothing when bitsandbytes is already imported."""
    blocked = "bitsandbytes" not in sys.modules
    if blocked:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # the documented way to make an import fail
    try:
        yield
    finally:
        if blocked and "bitsandbytes" in sys.modules and sys.modules["bitsandbytes"] is None:
            del sys.modules["bitsandbytes"]


def _peft():
    with _quiet_peft():
        import peft
    return peft


def lora_config(spec: Any, task: str | None = None):
    """A peft ``LoraConfig`` from a ``LoraConfig``, a short dict or a string (see :func:`parse_lora`)."""
    LoraConfig = _peft().LoraConfig

    if isinstance(spec, LoraConfig):
        spec = copy.deepcopy(spec)  # peft and apply_lora write to it: the caller's object stays as it was
        _number(vars(spec), "r", 1, MAX_RANK, whole=True)
        return spec
    if isinstance(spec, str):
        spec = parse_lora(spec)
    if isinstance(spec, bool) or not isinstance(spec, dict):
        raise HubError(
            f"lora= takes a peft LoraConfig, a dict like dict(r=16, alpha=32) or a string like 'r=16,alpha=32', "
            f"not {type(spec).__name__}"
        )
    if not all(isinstance(k, str) for k in spec):
        raise HubError(f"LoRA setting names must be strings, got {short(list(spec), 40)}")
    kwargs: dict[str, Any] = {_ALIASES[k] if k in _ALIASES else k: v for k, v in spec.items()}
    kwargs.setdefault("r", 16)
    _number(kwargs, "r", 1, MAX_RANK, whole=True)
    kwargs.setdefault("lora_alpha", 2 * kwargs["r"])
    _number(kwargs, "lora_alpha", -1e6, 1e6)
    _number(kwargs, "lora_dropout", 0, 1)
    for key in _LIST_KEYS:
        _names(kwargs, key)
    if task in _PEFT_TASKS:
        kwargs.setdefault("task_type", _PEFT_TASKS[task])
    try:
        return LoraConfig(**kwargs)
    except Exception as exc:  # noqa: BLE001 - peft's checks raise TypeError, ValueError, KeyError...
        raise HubError(f"bad LoRA settings {short(spec, 60)}: {reason(exc)}") from exc


def apply_lora(model: nn.Module, config) -> nn.Module:
    """``get_peft_model``; a model type peft has no default targets for uses ``all-linear``."""
    get_peft_model = _peft().get_peft_model
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if config.target_modules is None and model_type not in DEFAULT_TARGETS:
        config.target_modules = "all-linear"
    try:
        with _quiet_peft():
            return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, re.error) as exc:
        raise HubError(f"peft cannot wrap this model with {short(config.target_modules, 60)}: {reason(exc)}") from exc
