"""Activation checkpointing per region: full, or selective (per op type, save or recompute).

A *region* is a module whose forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Its :class:`RegionPolicy` says
what happens to the tensors its ops produce:

- ``none``: no checkpointing (the module runs as it is),
- ``full``: keep only the region's inputs, recompute everything in backward,
- ``selective``: per op type, save or recompute (``ops``), with a ``default`` for the rest;
  implemented with ``create_selective_checkpoint_contexts``.

Ops are named by their overload packet, ``"aten.mm"``, never by overload (``aten.mm.default``):
a SAC policy receives an ``OpOverload`` and comparing it against packets is always False, which
silently turns the policy into full checkpointing. :func:`make_policy_fn` compares
``op.overloadpacket``.

Wrapping sets ``forward`` as an instance attribute; :func:`unwrap_region` restores what was there
(nothing, usually). Nothing else on the module changes.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from memsave_nb.errors import MemsaveError

__all__ = [
    "PlanError",
    "RegionKind",
    "OpChoice",
    "RegionPolicy",
    "MATMUL_OPS",
    "COMPUTE_INTENSIVE_OPS",
    "POLICY_PRESETS",
    "policy_preset",
    "op_name",
    "make_policy_fn",
    "wrap_region",
    "unwrap_region",
    "suggest_regions",
]


class PlanError(MemsaveError, ValueError):
    """A plan that cannot apply to this model (unknown name, bad choice); the message names it."""


class RegionKind(str, enum.Enum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class OpChoice(str, enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"


# Overload packet names, as `str(op.overloadpacket)` spells them.
MATMUL_OPS: tuple[str, ...] = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")
ATTENTION_OPS: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
)
CONV_OPS: tuple[str, ...] = ("aten.convolution", "aten._convolution")
COMPUTE_INTENSIVE_OPS: tuple[str, ...] = MATMUL_OPS + CONV_OPS + ATTENTION_OPS


def _check_op_name(name: Any) -> str:
    if not isinstance(name, str) or name.count(".") != 1 or not all(name.split(".")):
        raise PlanError(f"op {name!r}: name ops by overload packet, e.g. 'aten.mm' (not 'aten.mm.default')")
    return name


@dataclass(frozen=True)
class RegionPolicy:
    """What a checkpointed region keeps. Plain data: JSON via :meth:`to_dict` / :meth:`from_dict`.

    ``ops`` maps op packet names ("aten.mm") to "save" or "recompute"; ops not listed follow
    ``default``. Only used when ``kind == "selective"``.
    """

    kind: RegionKind = RegionKind.FULL
    ops: Mapping[str, OpChoice] = field(default_factory=dict)
    default: OpChoice = OpChoice.RECOMPUTE

    def __post_init__(self) -> None:
        try:
            kind = RegionKind(self.kind)
            default = OpChoice(self.default)
            ops = {_check_op_name(k): OpChoice(v) for k, v in dict(self.ops).items()}
        except ValueError as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"region policy: {exc}") from None
        if kind is not RegionKind.SELECTIVE and (ops or default is not OpChoice.RECOMPUTE):
            raise PlanError(f"region policy {kind.value!r} takes no per-op choices")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "ops", dict(sorted(ops.items())))

    # convenience constructors -------------------------------------------------------------
    @classmethod
    def none(cls) -> "RegionPolicy":
        return cls(RegionKind.NONE)

    @classmethod
    def full(cls) -> "RegionPolicy":
        return cls(RegionKind.FULL)

    @classmethod
    def save(cls, ops: Iterable[str]) -> "RegionPolicy":
        """Selective: save these op types, recompute all others."""
        return cls(RegionKind.SELECTIVE, {o: OpChoice.SAVE for o in ops}, OpChoice.RECOMPUTE)

    @property
    def saved_ops(self) -> frozenset[str]:
        return frozenset(k for k, v in self.ops.items() if v is OpChoice.SAVE)

    @property
    def recomputed_ops(self) -> frozenset[str]:
        return frozenset(k for k, v in self.ops.items() if v is OpChoice.RECOMPUTE)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value}
        if self.kind is RegionKind.SELECTIVE:
            d["ops"] = {k: v.value for k, v in self.ops.items()}
            d["default"] = self.default.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> "RegionPolicy":
        if isinstance(data, str):
            return policy_preset(data)
        unknown = set(data) - {"kind", "ops", "default"}
        if unknown:
            raise PlanError(f"region policy: unknown keys {sorted(unknown)}")
        return cls(data.get("kind", "full"), data.get("ops", {}), data.get("default", "recompute"))

    def __hash__(self) -> int:
        return hash((self.kind, tuple(self.ops.items()), self.default))


POLICY_PRESETS: dict[str, RegionPolicy] = {
    "none": RegionPolicy.none(),
    "full": RegionPolicy.full(),
    "save_matmuls": RegionPolicy.save(MATMUL_OPS),
    "save_compute_intensive": RegionPolicy.save(COMPUTE_INTENSIVE_OPS),
    "recompute_all": RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.RECOMPUTE),
}


def policy_preset(name: str) -> RegionPolicy:
    """One of :data:`POLICY_PRESETS` by name (``-`` and spaces accepted for ``_``)."""
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key not in POLICY_PRESETS:
        raise PlanError(f"region policy preset {name!r}: choose one of {sorted(POLICY_PRESETS)}")
    return POLICY_PRESETS[key]


def op_name(op: Any) -> str:
    """``"aten.mm"`` for ``aten.mm.default`` (and for the packet itself); ``str(op)`` otherwise."""
    packet = getattr(op, "overloadpacket", op)
    return str(packet)


def _mutates(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


# Never saved by a "save everything else" default: fresh buffers that a later in-place op fills
# (dropout: empty_like, then bernoulli_) would be cached and then mutated, which SAC rejects;
# views cost nothing to redo and share their base's storage anyway.
CREATION_OPS = frozenset(
    f"aten.{n}"
    for n in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
        "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor",
        "clone", "detach", "alias", "lift_fresh",
    )
)


def _cheap(op: Any) -> bool:
    return op_name(op) in CREATION_OPS or bool(getattr(op, "is_view", False))


def make_policy_fn(policy: RegionPolicy) -> Callable[..., CheckpointPolicy]:
    """A SAC ``policy_fn(ctx, op, *args, **kwargs)`` for a selective region policy."""
    saved = policy.saved_ops
    recomputed = policy.recomputed_ops
    default = (
        CheckpointPolicy.MUST_SAVE if policy.default is OpChoice.SAVE else CheckpointPolicy.PREFER_RECOMPUTE
    )

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _mutates(op):
            # an in-place op (batch-norm statistics, counters): a cached tensor that changes
            # afterwards makes backward fail; recompute it, as full checkpointing does
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = op_name(op)  # compares the packet, never the OpOverload
        if name in saved:
            return CheckpointPolicy.MUST_SAVE
        if name in recomputed or _cheap(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return default

    return policy_fn


def context_fn_for(policy: RegionPolicy) -> Callable[[], Any]:
    if policy.kind is RegionKind.SELECTIVE:
        return functools.partial(create_selective_checkpoint_contexts, make_policy_fn(policy))
    return noop_context_fn


_MISSING = object()
_WRAPPED_MARK = "__memsave_region__"


def wrap_region(module: nn.Module, policy: RegionPolicy) -> Callable[[], None]:
    """Make ``module``'s forward run checkpointed under ``policy``; returns the undo function.

    The wrapper is an instance attribute ``forward``; undo deletes it (or puts back an instance
    ``forward`` the module had before). A ``none`` policy changes nothing.
    """
    if policy.kind is RegionKind.NONE:
        return lambda: None
    previous = module.__dict__.get("forward", _MISSING)
    inner = module.forward  # bound method, or a previous instance attribute
    context_fn = context_fn_for(policy)

    if context_fn is noop_context_fn:  # torch.compile traces checkpoint only without a no-op context_fn

        def forward(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    else:

        def forward(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    setattr(forward, _WRAPPED_MARK, policy)
    module.forward = forward  # type: ignore[method-assign]

    def undo() -> None:
        unwrap_region(module, previous)

    return undo


def unwrap_region(module: nn.Module, previous: Any = _MISSING) -> None:
    if previous is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = previous


def is_wrapped(module: nn.Module) -> bool:
    return hasattr(module.__dict__.get("forward"), _WRAPPED_MARK)


def suggest_regions(model: nn.Module) -> list[str]:
    """Names of the repeated blocks: children of each ``ModuleList``/``Sequential`` whose children
    all share one class (at least two). Outermost lists win; nested ones inside a suggested block
    are not listed again."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name == f or name.startswith(f + ".") for f in found):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        child_type = type(children[0][1])
        if not any(True for _ in children[0][1].parameters()):
            continue  # a list of parameter-free modules (activations) is no block
        if child_type in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d):
            continue  # a stack of single layers: too fine to be worth a region
        prefix = f"{name}." if name else ""
        found.extend(prefix + child for child, _ in children)
    return found
