"""Apply a ``ParallelSpec`` to a module: FSDP2 ``fully_shard`` per unit plus the root, or DDP.

Used on the fake twin (fake mode) and on each real rank's model (the gloo cross-check), so both
run the very same calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Iterator

import torch
from torch import nn

from ..parallel_spec import ParallelError, ParallelSpec


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
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=_dtype(spec.param_dtype), reduce_dtype=_dtype(spec.reduce_dtype)
        )
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

    if spec.tensor_parallel > 1:  # TP first, on the mesh's last dimension; FSDP2 over the rest
        from .tp import apply_tensor_parallel

        apply_tensor_parallel(model, spec, mesh["tp"])
        if spec.data_parallel == 1:
            return model
        mesh = mesh[spec.mesh_dim_names[:-1]]
    kw = fsdp_kwargs(spec, mesh)
    with _rank_chunk_only() if fake else contextlib.nullcontext():
        for name in shard_units(model, spec):
            fully_shard(model.get_submodule(name), **kw)
        fully_shard(model, **dict(kw, reshard_after_forward=spec.reshard_root))
    return model


class _LazyChunks(Sequence):
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n``, each chunk made on demand.

    FSDP2 chunks every parameter into shard-group-size pieces and keeps one: on fake tensors each
    piece costs a fake tensor, 64 per parameter at 64 ranks (most of ``fully_shard``'s time there).
    Item ``i`` is the same view ``torch.chunk`` returns (``narrow`` of the same storage, same size,
    stride and offset); views allocate nothing, so the sizing is unchanged (the FSDPMemTracker
    tests shard without this and agree byte for byte).
    """

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        d = tensor.size(dim)
        self.step = -(-d // num_chunks) if d else 0
        self.real = -(-d // self.step) if self.step else 0  # what torch.chunk returns
        if d == 0:
            self.real = num_chunks  # torch.chunk of an empty dim returns n empty chunks

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        if i < 0:
            i += self.num_chunks
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        if i < self.real:
            d = self.tensor.size(self.dim)
            start = i * self.step
            return self.tensor.narrow(self.dim, start, min(self.step, d - start))
        return self[0].new_empty(0)


@contextlib.contextmanager
def _rank_chunk_only() -> Iterator[None]:
    """While sharding in fake mode, FSDP2's ``_chunk_with_empty`` builds only the chunks it reads."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param as fp_mod
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(fp_mod, "_chunk_with_empty", None)
    if original is None:  # pragma: no cover
        yield
        return
    fp_mod._chunk_with_empty = _LazyChunks  # type: ignore[assignment]  # a lazy Sequence where FSDP2 only indexes the list
    try:
        yield
    finally:
        fp_mod._chunk_with_empty = original


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
    from .tp import tp_local_shapes  # under TP, FSDP2 shards each rank's TP shard

    dims = [s[0] if s else 1 for s in tp_local_shapes(model, spec).values()]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(spec.world_size):
        s = (rank // spec.tensor_parallel) % n  # the mesh is (replicate?, shard, tp?), row-major
        sig = tuple(min(-(-d // n), max(0, d - s * -(-d // n))) for d in dims)
        groups.setdefault(sig, []).append(rank)
    return [tuple(r) for r in groups.values()]
