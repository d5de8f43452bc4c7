"""Tensor parallel: a ``ParallelSpec``'s TP plan resolved and checked on a model, and applied
with PyTorch's ``parallelize_module`` on the mesh's ``tp`` dimension.

The plan's functions live in ``tp_plan.py`` (below the plan, so ``to_code`` writes the very same
ones): the default is the Megatron / torchtitan plan for decoders, attention q, k, v (or a fused
qkv) and the MLP's up / gate column-wise, the attention output and MLP down row-wise (one
all-reduce after each), the input embedding row-wise over the vocabulary, the output head
column-wise with the logits gathered (no loss parallel). Here: the checks (split dims and head
counts divisible by the degree), each rank's parameter shapes, and the call.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import quoted
from ..parallel_spec import ParallelError, ParallelSpec
from ..tp_plan import default_tp_plan, matched_tp_plan, tp_styles


def resolve_tp_plan(model: nn.Module, spec: ParallelSpec) -> list[tuple[str, str]]:
    """The spec's plan as concrete module names (its patterns expanded), checked against ``model``."""
    if not spec.tp_plan:
        plan = default_tp_plan(model, spec.sequence_parallel)
        if not any(s == "colwise" for _, s in plan):
            raise ParallelError(
                "tensor_parallel: no attention or MLP projections found for the default plan; pass tp_plan"
            )
        if spec.sequence_parallel and any(n.endswith(".base_layer") for n, _ in plan):
            raise ParallelError(
                "sequence_parallel with LoRA layers: peft adds lora_B's plain output to the base layer's "
                "sequence-sharded DTensor; size TP without sequence_parallel"
            )
    else:
        names = [n for n, _ in model.named_modules() if n]
        for pattern, _ in spec.tp_plan:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ParallelError(f"tp_plan: no module matches {quoted(pattern)}")
        plan = matched_tp_plan(model, spec.tp_plan)
    modules = dict(model.named_modules())
    for name, style in plan:
        mod = modules[name]
        if style in ("norm", "gather_input", "gather_hidden_states"):
            continue
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            raise ParallelError(
                f"tp_plan: {quoted(name)} is a {type(mod).__name__}; style {quoted(style)} splits a Linear or Embedding"
            )
    _check_divisible(model, plan, spec.tensor_parallel)
    return plan


def _sharded_dims(mod: nn.Module, style: str) -> dict[str, int | None]:
    """Parameter name -> the dim TP splits (None: replicated), as PyTorch's styles shard them."""
    if style in ("norm", "gather_input", "gather_hidden_states"):
        return {n: None for n, _ in mod.named_parameters(recurse=False)}
    # torch shards an Embedding's weight on dim 1 column-wise and dim 0 row-wise; a Linear's on
    # dim 0 column-wise (its bias too) and dim 1 row-wise (its bias replicated)
    colwise = style in ("colwise", "head")
    if isinstance(mod, nn.Embedding):
        return {"weight": 1 if colwise else 0}
    return {"weight": 0 if colwise else 1, "bias": 0 if colwise else None}


def _check_divisible(model: nn.Module, plan: list[tuple[str, str]], tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan:
        mod = modules[name]
        for pname, dim in _sharded_dims(mod, style).items():
            p = getattr(mod, pname, None)
            if p is not None and dim is not None and p.shape[dim] % tp:
                raise ParallelError(f"tensor_parallel {tp} does not divide {name}.{pname} dim {dim} ({p.shape[dim]})")
    heads = []
    # the model's config, or its layers' (a pipeline stage holds layers, not the model: PP x TP)
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        for attr in ("num_attention_heads", "num_key_value_heads", "n_head"):
            heads.append((attr, getattr(config, attr, None)))
    heads += [("n_head", getattr(m, "n_head", None)) for m in model.modules()]
    for attr, n in heads:
        if isinstance(n, int) and n % tp:
            raise ParallelError(f"tensor_parallel {tp} does not divide {attr} ({n}): each rank holds whole heads")


def tp_local_shapes(model: nn.Module, spec: ParallelSpec) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape on one TP rank (every TP rank alike: the split dims divide evenly)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if spec.tensor_parallel == 1:
        return shapes
    modules = dict(model.named_modules())
    for name, style in resolve_tp_plan(model, spec):
        for pname, dim in _sharded_dims(modules[name], style).items():
            full = f"{name}.{pname}" if name else pname
            if dim is not None and full in shapes:
                s = list(shapes[full])
                s[dim] //= spec.tensor_parallel
                shapes[full] = tuple(s)
    return shapes


def apply_tensor_parallel(model: nn.Module, spec: ParallelSpec, tp_mesh: Any) -> nn.Module:
    """``parallelize_module`` with the spec's plan on the ``tp`` mesh (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, tp_styles(resolve_tp_plan(model, spec), spec.sequence_parallel))


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches.

    They are keyed by specs that compare device meshes by shape and names, so a later measurement
    (a new fake process group, an equal mesh) gets outputs placed on a mesh of an earlier, destroyed
    group and its redistribution fails ("Could not resolve the process group registered under the
    name N"): seen on the second TP measurement in one process, and in ranks forked after one.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    prop = DTensor._op_dispatcher.sharding_propagator
    for cache in (
        getattr(prop, "propagate_op_sharding", None),
        getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        clear = getattr(cache, "cache_clear", None)
        if callable(clear):
            clear()
    for clear in (
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
    ):  # the C++ fast path's
        if callable(clear):
            clear()


@contextlib.contextmanager
def waits_return_their_tensor() -> Iterator[None]:
    """In fake mode, a functional collective's wait returns the collective's output itself.

    TP's redistributions (the all-reduce after a row-wise layer, the all-gather of the logits) run
    as functional collectives; while tracing, which fake mode counts as, each result passes through
    ``_c10d_functional.wait_tensor``, whose fake kernel makes a new tensor (its schema declares no
    alias), so a dispatch-level counter sees a second buffer of the same size. In eager runs the
    wait hands back the very tensor (``AsyncCollectiveTensor.wait``): one buffer. While active, the
    wait on a fake tensor returns it (nothing else changes: the collective still runs).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed import _functional_collectives as funcol

    original = getattr(funcol, "wait_tensor", None)
    if original is None:  # pragma: no cover
        yield
        return

    def wait_tensor(tensor):
        return tensor if isinstance(tensor, FakeTensor) else original(tensor)

    funcol.wait_tensor = wait_tensor
    try:
        yield
    finally:
        funcol.wait_tensor = original
