"""Apply a ``ParallelSpec`` to a module: FSDP2 ``fully_shard`` per unit plus the root, or DDP.

Used on the fake twin (fake mode) and on each real rank's model (the gloo cross-check), so both
run the very same calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .spec import ParallelError, ParallelSpec


def shard_units(model: nn.Module, spec: ParallelSpec) -> list[str]:
    """Module names that become FSDP units (the root is added by ``apply_parallel``)."""
    if spec.shard_modules:
        names = dict(model.named_modules())
        for n in spec.shard_modules:
            if n not in names:
                raise ParallelError(f"shard_modules: the model has no module named {n!r}")
        return [n for n in spec.shard_modules if n]
    from ..checkpointing import suggest_regions

    return suggest_regions(model)


def _dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


def fsdp_kwargs(spec: ParallelSpec, mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.param_dtype or spec.reduce_dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=_dtype(spec.param_dtype), reduce_dtype=_dtype(spec.reduce_dtype))
    if spec.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return kw


def apply_parallel(model: nn.Module, spec: ParallelSpec, mesh: Any, *, fake: bool = False) -> nn.Module:
    """Shard (in place) or wrap ``model``; returns the module the step should call.

    ``fake``: on the fake backend (DDP needs two changes there, see ``ddp.py``).
    """
    if spec.strategy == "ddp":
        from .ddp import wrap_ddp

        return wrap_ddp(model, spec, fake=fake)
    from torch.distributed.fsdp import fully_shard

    kw = fsdp_kwargs(spec, mesh)
    for name in shard_units(model, spec):
        fully_shard(model.get_submodule(name), **kw)
    fully_shard(model, **kw)
    return model


def fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's per-parameter records (``FSDPParam``) of every unit under ``model``."""
    out = []
    for mod in model.modules():
        get = getattr(mod, "_get_fsdp_state", None)
        if get is None:
            continue
        group = getattr(get(), "_fsdp_param_group", None)
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def unsharded_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 all-gathers parameters into (their storages outlive each step)."""
    out: list[torch.Tensor] = []
    for fp in fsdp_params(model):
        out.extend(getattr(fp, "all_gather_outputs", ()) or ())
        up = getattr(fp, "_unsharded_param", None)
        if up is not None:
            out.append(up)
    return out


def rank_layouts(model: nn.Module, spec: ParallelSpec) -> list[tuple[int, ...]]:
    """Groups of ranks whose local shards have the same shapes (first rank first).

    FSDP2 shards each parameter on dim 0 like ``torch.chunk`` over the shard group: rank ``s`` of
    the group holds ``min(c, max(0, d - s*c))`` rows with ``c = ceil(d / shard_size)``. Ranks with
    equal row counts for every parameter run the same program on a fake group, so one of each
    group is measured; the worst is the largest of them. DDP: one group.
    """
    n = spec.shard_size
    if spec.strategy == "ddp" or n == 1:
        return [tuple(range(spec.world_size))]
    dims = [p.shape[0] if p.dim() else 1 for p in model.parameters()]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(spec.world_size):
        s = rank % n
        sig = tuple(min(-(-d // n), max(0, d - s * -(-d // n))) for d in dims)
        groups.setdefault(sig, []).append(rank)
    return [tuple(r) for r in groups.values()]
