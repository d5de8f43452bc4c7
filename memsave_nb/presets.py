"""Plans for the common fine-tuning setups, built from a model's own names.

Each preset takes a model (or a Workload) and returns a :class:`~memsave_nb.plan.Plan`; names are
resolved here, so the plan is explicit and validates against the model. :func:`presets_for`
lists the presets that make sense for a model (no "norm layers only" without norm layers, no
LoRA without adapters), as ``{label: Plan}``.

Tied parameters (GPT-2's ``lm_head.weight`` *is* ``transformer.wte.weight``) are one parameter: it
trains when a preset selects any of its names, so "head only" on GPT-2 trains the embedding too.
A preset whose plan trains a parameter through a tie says so in its name (:func:`memsave_nb.hf.tie_note`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from torch import nn

from memsave_nb.checkpointing import PlanError, suggest_regions
from memsave_nb.hf import tie_note
from memsave_nb.plan import ALL, Plan

__all__ = [
    "all_trainable",
    "input_only",
    "last_blocks",
    "head_only",
    "bias_only",
    "norm_only",
    "first_quarter",
    "last_quarter",
    "lora_only",
    "has_adapters",
    "head_name",
    "parameterised_layers",
    "presets_for",
    "PRESETS",
]

NORM_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
NORM_NAME_ENDINGS = ("RMSNorm", "LayerNorm", "GroupNorm")
ADAPTER_WORDS = ("lora", "adapter")
HEAD_NAMES = ("head", "lm_head", "classifier", "fc", "output", "out_proj", "score")


def _model(obj: Any) -> nn.Module:
    # A module is taken as it is: Hugging Face models have a ``.model`` attribute of their own
    # (the inner decoder), which must not be mistaken for a Workload's model.
    model = obj if isinstance(obj, nn.Module) else getattr(obj, "model", obj)
    if not isinstance(model, nn.Module):
        raise PlanError(f"a preset needs a model or a workload, got {type(obj).__name__}")
    return model


def parameterised_layers(model: nn.Module) -> list[str]:
    """Modules that own parameters directly, in ``named_modules()`` order."""
    return [n for n, m in model.named_modules() if any(p is not None for p in m._parameters.values())]


def all_trainable(model: Any) -> Plan:
    return Plan(name="all trainable", trainable=(ALL,))


def input_only(model: Any, *, bn_eval: bool = False) -> Plan:
    """Every parameter frozen, the input requires grad (e.g. adversarial examples, input
    attribution). With ``bn_eval`` batch norm uses running statistics (the paper's best case)."""
    _model(model)
    return Plan(
        name="input only" + (", BN eval" if bn_eval else ""),
        frozen=(ALL,),
        input_requires_grad=True,
        bn_eval=(ALL,) if bn_eval else (),
    )


def last_blocks(model: Any, n: int = 1, *, blocks: list[str] | None = None) -> Plan:
    """Only the last ``n`` repeated blocks train (see :func:`suggest_regions`)."""
    m = _model(model)
    blocks = list(blocks) if blocks is not None else suggest_regions(m)
    if not blocks:
        raise PlanError(f"{type(m).__name__} has no repeated blocks (a ModuleList of one class) to pick the last of")
    if n < 1:
        raise PlanError(f"last_blocks: n must be at least 1, got {n}")
    chosen = tuple(blocks[-n:])
    return _noted(Plan(name=f"last {len(chosen)} block{'s' * (len(chosen) != 1)}", frozen=(ALL,), trainable=chosen), m)


def head_name(model: nn.Module) -> str:
    """The output layer: a child named like a head (head, lm_head, classifier, fc...) that has
    parameters, else the last module owning parameters."""
    children = dict(model.named_children())
    for name in HEAD_NAMES:
        child = children.get(name)
        if child is not None and any(True for _ in child.parameters()):
            return name
    layers = parameterised_layers(model)
    if not layers:
        raise PlanError(f"{type(model).__name__} has no parameters")
    return layers[-1]


def head_only(model: Any) -> Plan:
    m = _model(model)
    head = head_name(m)
    plan = Plan(name="head only", frozen=(ALL,), trainable=(head,))
    return _noted(plan, m)


def _noted(plan: Plan, model: nn.Module) -> Plan:
    """The plan, its name saying what it trains through tied parameters."""
    note = tie_note(plan, model)
    return plan.replace(name=plan.name + note) if note else plan


def bias_only(model: Any) -> Plan:
    """BitFit: only the biases train."""
    m = _model(model)
    names = tuple(n for n, _ in m.named_parameters() if n.rsplit(".", 1)[-1] == "bias")
    if not names:
        raise PlanError(f"{type(m).__name__} has no bias parameters")
    return _noted(Plan(name="bias only (BitFit)", frozen=(ALL,), trainable=names), m)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: torch's own, or a model library's leaf layer named like one
    (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``...)."""
    if isinstance(module, NORM_TYPES):
        return True
    return type(module).__name__.endswith(NORM_NAME_ENDINGS) and not module._modules


def norm_only(model: Any) -> Plan:
    m = _model(model)
    names = tuple(n for n, mod in m.named_modules() if is_norm(mod) and any(True for _ in mod.parameters()))
    if not names:
        raise PlanError(f"{type(m).__name__} has no normalisation layers with parameters")
    return _noted(Plan(name="norm layers only", frozen=(ALL,), trainable=names), m)


def _quarter(model: nn.Module) -> tuple[list[str], int]:
    layers = parameterised_layers(model)
    if not layers:
        raise PlanError(f"{type(model).__name__} has no parameters")
    return layers, max(1, math.ceil(len(layers) / 4))


def first_quarter(model: Any, *, input_requires_grad: bool | None = None) -> Plan:
    """The paper's "surgical" case: the first quarter of the parameterised layers trains."""
    m = _model(model)
    layers, k = _quarter(m)
    plan = Plan(
        name="first quarter", frozen=(ALL,), trainable=tuple(layers[:k]), input_requires_grad=input_requires_grad
    )
    return _noted(plan, m)


def last_quarter(model: Any, *, input_requires_grad: bool | None = None) -> Plan:
    """The paper's other "surgical" case: the last quarter of the parameterised layers trains."""
    m = _model(model)
    layers, k = _quarter(m)
    plan = Plan(
        name="last quarter", frozen=(ALL,), trainable=tuple(layers[-k:]), input_requires_grad=input_requires_grad
    )
    return _noted(plan, m)


def _adapter_names(model: nn.Module) -> tuple[str, ...]:
    def is_adapter(name: str) -> bool:
        return any(w in part.lower() for part in name.split(".") for w in ADAPTER_WORDS)

    names: list[str] = []
    for name, _ in model.named_parameters():
        if not is_adapter(name):
            continue
        # name the outermost adapter module (or the parameter) once
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if is_adapter(prefix.rsplit(".", 1)[-1]):
                break
        if prefix not in names:
            names.append(prefix)
    return tuple(names)


def has_adapters(model: Any) -> bool:
    return bool(_adapter_names(_model(model)))


def lora_only(model: Any) -> Plan:
    """LoRA-style: the base model frozen, adapters (names containing lora/adapter) trainable."""
    m = _model(model)
    names = _adapter_names(m)
    if not names:
        raise PlanError(f"{type(m).__name__} has no adapter parameters (no name contains {' or '.join(ADAPTER_WORDS)})")
    return _noted(Plan(name="adapters only (LoRA)", frozen=(ALL,), trainable=names), m)


PRESETS: dict[str, Callable[..., Plan]] = {
    "all trainable": all_trainable,
    "input only": input_only,
    "input only, BN eval": lambda m: input_only(m, bn_eval=True),
    "last block": last_blocks,
    "head only": head_only,
    "bias only (BitFit)": bias_only,
    "norm layers only": norm_only,
    "first quarter": first_quarter,
    "last quarter": last_quarter,
    "adapters only (LoRA)": lora_only,
}


def presets_for(model: Any) -> dict[str, Plan]:
    """The presets that apply to this model, ``{label: plan}`` (inapplicable ones left out).

    Given a Workload, the input-only presets are left out too when its batch holds no floating
    tensor (token ids cannot require grad)."""
    m = _model(model)
    has_bn = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in m.modules())
    float_input = True
    if hasattr(model, "make_batch") and not callable(getattr(model, "batch", None)):
        from memsave_nb.workload import iter_tensors

        float_input = any(t.is_floating_point() for t in iter_tensors(model.batch))
    out: dict[str, Plan] = {}
    for label, fn in PRESETS.items():
        if label == "input only, BN eval" and not has_bn:
            continue
        if label.startswith("input only") and not float_input:
            continue
        try:
            plan = fn(m)
        except PlanError:
            continue
        out[label] = plan.replace(name=label + tie_note(plan, m))
    return out
