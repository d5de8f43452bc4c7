"""Activation checkpointing per region: full, or selective (per op type, save or recompute).

A *region* is a module whose forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Its :class:`RegionPolicy` says
what happens to the tensors its ops produce:

- ``none``: no checkpointing (the module runs as it is),
- ``full``: keep only the region's inputs, recompute everything in backward,
- ``selective``: per op type, save or recompute (``ops``), with a ``default`` for the rest;
  implemented with ``create_selective_checkpoint_contexts``,
- ``offload``: no checkpoint; what the region saves goes to host memory (:mod:`memsave_nb.offload`),
- ``full_offload``: full checkpoint, and the inputs it keeps go to host memory (TRL's
  ``activation_offloading`` with gradient checkpointing on; tensors under TRL's 1024-byte
  threshold stay).

Ops are named by their overload packet, ``"aten.mm"``, never by overload (``aten.mm.default``):
a SAC policy receives an ``OpOverload`` and comparing it against packets is always False, which
silently turns the policy into full checkpointing. :func:`make_policy_fn` compares
``op.overloadpacket``.

Wrapping sets ``forward`` as an instance attribute; :func:`unwrap_region` restores what was there
(nothing, usually). Nothing else on the module changes.
"""

from __future__ import annotations

import enum
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from memsave_nb.errors import PlanError, quoted

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
    "check_nesting",
    "unwrap_region",
    "suggest_regions",
]


class RegionKind(str, enum.Enum):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"
    OFFLOAD = "offload"  # tensors saved in the region go to host memory (see offload.py)
    # full checkpoint whose kept inputs go to host memory (TRL's activation_offloading with
    # gradient checkpointing: the checkpoint's inputs are the only tensors the region saves)
    FULL_OFFLOAD = "full_offload"


class OpChoice(str, enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"


# Overload packet names, as `str(op.overloadpacket)` spells them.
# aten._grouped_mm: the experts of mixture-of-experts layers (transformers' Mixtral, Qwen-MoE...), one
# matmul per expert over its share of the tokens.
MATMUL_OPS: tuple[str, ...] = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm")
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


_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


def show(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: one short line for an error message."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - RecursionError on a deeply nested value, a broken __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_op_name(name: Any) -> str:
    """An op's overload packet name (``"aten.mm"``) that resolves in ``torch.ops``."""
    if not isinstance(name, str) or not _OP_NAME.fullmatch(name):
        raise PlanError(f"op {show(name)}: name ops by overload packet, e.g. 'aten.mm' (not 'aten.mm.default')")
    namespace, op = name.split(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise PlanError(f"op {quoted(name)} is not an operator in torch.ops (load its library before the plan)")
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
        if not isinstance(self.ops, Mapping):
            raise PlanError(f"region policy: ops must map op names to 'save'/'recompute', got {show(self.ops)}")
        for label, value in [("kind", self.kind), ("default", self.default), *self.ops.items()]:
            if not isinstance(value, str):  # enums are str subclasses; JSON gives plain strings
                raise PlanError(f"region policy: {show(label)} must be a string choice, got {show(value)}")
        try:
            kind = RegionKind(self.kind)
            default = OpChoice(self.default)
            ops = {_check_op_name(k): OpChoice(v) for k, v in dict(self.ops).items()}
        except (ValueError, TypeError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"region policy: {show(str(exc), 100)[1:-1]}") from None
        if kind is not RegionKind.SELECTIVE and (ops or default is not OpChoice.RECOMPUTE):
            raise PlanError(f"region policy {quoted(kind.value)} takes no per-op choices")
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
        if isinstance(data, RegionPolicy):
            return data
        if isinstance(data, str):
            return policy_preset(data)
        if not isinstance(data, Mapping):
            raise PlanError(f"region policy: expected a preset name or an object, got {show(data)}")
        unknown = set(data) - {"kind", "ops", "default"}
        if unknown:
            raise PlanError(f"region policy: unknown keys {show(sorted(map(str, unknown)))}")
        return cls(data.get("kind", "full"), data.get("ops", {}), data.get("default", "recompute"))

    def __hash__(self) -> int:
        return hash((self.kind, tuple(self.ops.items()), self.default))


POLICY_PRESETS: dict[str, RegionPolicy] = {
    "none": RegionPolicy.none(),
    "full": RegionPolicy.full(),
    "save_matmuls": RegionPolicy.save(MATMUL_OPS),
    "save_compute_intensive": RegionPolicy.save(COMPUTE_INTENSIVE_OPS),
    "recompute_all": RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.RECOMPUTE),
    "offload": RegionPolicy(RegionKind.OFFLOAD),
    "full_offload": RegionPolicy(RegionKind.FULL_OFFLOAD),
}


def policy_preset(name: str) -> RegionPolicy:
    """One of :data:`POLICY_PRESETS` by name (``-`` and spaces accepted for ``_``)."""
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key not in POLICY_PRESETS:
        raise PlanError(f"region policy preset {show(name)}: choose one of {sorted(POLICY_PRESETS)}")
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
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "scalar_tensor",
        "clone",
        "detach",
        "alias",
        "lift_fresh",
    )
)


def _cheap(op: Any) -> bool:
    return op_name(op) in CREATION_OPS or bool(getattr(op, "is_view", False))


def make_policy_fn(policy: RegionPolicy, region: str = "") -> Callable[..., CheckpointPolicy]:
    """A SAC ``policy_fn(ctx, op, *args, **kwargs)`` for a selective region policy.

    Besides deciding, it remembers the storages of the outputs it told SAC to cache during
    forward. An op that then writes into one of them (an in-place ReLU after a saved batch norm,
    a memory-saving max-pool shifting its saved indices) would make SAC fail in backward with
    "cached tensor has been mutated", or hand back the changed values: it is refused there and
    then with a :class:`PlanError` naming the region and both ops. Build one per checkpointed
    call (:func:`context_fn_for` does), so the record lives as long as that call's cache.
    """
    saved = policy.saved_ops
    recomputed = policy.recomputed_ops
    default = CheckpointPolicy.MUST_SAVE if policy.default is OpChoice.SAVE else CheckpointPolicy.PREFER_RECOMPUTE
    cached: dict[int, str] = {}  # storage address -> op whose output SAC keeps (alive while cached)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        forward = ctx is not None and not ctx.is_recompute and not torch.compiler.is_compiling()
        if _mutates(op):
            if forward and cached:
                _refuse_write_into_cached(op, args, kwargs, cached, region)
            # an in-place op (batch-norm statistics, counters): a cached tensor that changes
            # afterwards makes backward fail; recompute it, as full checkpointing does
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = op_name(op)  # compares the packet, never the OpOverload
        if name in saved:
            decision = CheckpointPolicy.MUST_SAVE
        elif name in recomputed or _cheap(op):
            decision = CheckpointPolicy.PREFER_RECOMPUTE
        else:
            decision = default
        if decision is CheckpointPolicy.MUST_SAVE and forward:
            for t in _tensors(getattr(ctx, "op_output", None)):
                cached.setdefault(_storage_key(t), name)
        return decision

    return policy_fn


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _refuse_write_into_cached(op: Any, args: tuple, kwargs: dict, cached: dict[int, str], region: str) -> None:
    schema = op._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        for t in _tensors(value):
            source = cached.get(_storage_key(t))
            if source is not None:
                raise PlanError(
                    f"region {quoted(region)}: {op_name(op)} writes in place into the output of {source}, which the "
                    f"policy saves; recompute {source} (or use full checkpointing) for this region"
                )


def context_fn_for(policy: RegionPolicy, region: str = "") -> Callable[[], Any]:
    if policy.kind is RegionKind.SELECTIVE:

        def context_fn() -> Any:  # a fresh policy_fn (and its record of cached storages) per call
            return create_selective_checkpoint_contexts(make_policy_fn(policy, region))

        return context_fn
    return noop_context_fn


_MISSING = object()
_WRAPPED_MARK = "__memsave_region__"


def wrap_region(module: nn.Module, policy: RegionPolicy, name: str = "") -> Callable[[], None]:
    """Make ``module``'s forward run checkpointed under ``policy``; returns the undo function.

    The wrapper is an instance attribute ``forward``; undo deletes it (or puts back an instance
    ``forward`` the module had before). A ``none`` policy changes nothing.

    Refused with :class:`PlanError` (``name`` is the module's name, for the message): a module
    that writes into its own input (``nn.ReLU(inplace=True)``, or a ``Sequential`` starting with
    one) at wrapping; any other forward that changes the region's input in place at its first
    call, before backward could fail or go wrong.

    Before each checkpointed call, memory-saving layers' pending outputs are compacted (outside
    the region: inside, :func:`memsave_nb.layers.compact` does nothing, since its ops would
    land in selective checkpointing's op-ordered cache).
    """
    if policy.kind is RegionKind.NONE:
        return lambda: None
    culprit = _writes_into_input(module)
    if culprit is not None:
        raise PlanError(
            f"region {quoted(name)}: {culprit} changes the region's input in place, which checkpointing "
            f"cannot recompute; make a module around it the region"
        )
    previous = module.__dict__.get("forward", _MISSING)
    inner = module.forward  # bound method, or a previous instance attribute
    context_fn = context_fn_for(policy, name)
    label = type(module).__name__

    if policy.kind is RegionKind.OFFLOAD:
        from memsave_nb.offload import offloading

        def call(*args: Any, **kwargs: Any) -> Any:
            with offloading(module):
                return inner(*args, **kwargs)

    elif policy.kind is RegionKind.FULL_OFFLOAD:
        from memsave_nb.offload import TRL_MIN_OFFLOAD_BYTES, offloading

        def call(*args: Any, **kwargs: Any) -> Any:  # the checkpoint saves its inputs under these hooks
            passed = _tensors(list(args) + list(kwargs.values()))
            if len({id(t) for t in passed}) < len(passed):
                # saved-tensor hooks give one tensor saved twice back as two objects: a forward that
                # tests its inputs' identity (nn.MultiheadAttention's ``query is key``) recomputes
                # another path and torch's checkpoint fails in backward (save_on_cpu, TRL's hooks alike)
                raise PlanError(
                    f"region {quoted(name)}: {label} gets one tensor as several inputs, and checkpointing "
                    "under offload hooks recomputes it as different tensors; use 'full' or 'offload' here"
                )
            with offloading(module, min_bytes=TRL_MIN_OFFLOAD_BYTES):
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    elif context_fn is noop_context_fn:  # torch.compile traces checkpoint only without a no-op context_fn

        def call(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    else:

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except RuntimeError as exc:  # raised by SAC's cache while recomputing, in backward
                if "selective activation checkpoint has been mutated" in str(exc):
                    raise PlanError(
                        f"region {quoted(name)}: a tensor its policy saves was changed in place after the "
                        f"region (an in-place op such as ReLU(inplace=True) on its output?); "
                        f"recompute that op's producer or use full checkpointing"
                    ) from None
                raise

        def call(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return call(*args, **kwargs)
        _flush_pending_masks()
        inputs = _tensors(list(args) + list(kwargs.values()))
        versions = [t._version for t in inputs]
        out = call(*args, **kwargs)
        if any(t._version != v for t, v in zip(inputs, versions)):
            raise PlanError(
                f"region {quoted(name)}: {label}.forward changes its input in place, which checkpointing "
                f"cannot recompute; make a module around it the region"
            )
        return out

    setattr(forward, _WRAPPED_MARK, policy)
    module.forward = forward  # type: ignore[method-assign]

    def undo() -> None:
        unwrap_region(module, previous)

    return undo


def check_nesting(regions: Mapping[str, RegionPolicy]) -> None:
    """Refuse a selective region inside another checkpointed region (names: ``a.b`` is inside
    ``a``; everything is inside the root ``""``). Torch's recomputation of the outer region
    replays the inner one's op cache out of order ("... not found in storage") for some models."""
    active = {n: p for n, p in regions.items() if p.kind is not RegionKind.NONE}
    for inner, policy in active.items():
        if policy.kind is not RegionKind.SELECTIVE:
            continue
        for outer in active:
            if outer != inner and (outer == "" or inner.startswith(outer + ".")):
                raise PlanError(
                    f"region {quoted(inner)} is selective inside region {quoted(outer)}: nested selective "
                    "checkpointing is not supported: drop one or make the inner full"
                )


def _writes_into_input(module: nn.Module) -> str | None:
    """``"ReLU(inplace=True)"`` when the module's first step writes into its input, else None."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    if getattr(module, "inplace", False) is True:
        return f"{type(module).__name__}(inplace=True)"
    return None


def _flush_pending_masks() -> None:
    holder = sys.modules.get("memsave_nb.layers._holder")  # only if memory-saving layers are in use
    if holder is not None:
        holder.compact()


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
