"""Which ops selective checkpointing cannot keep, found before a run, and what a preset would keep.

SAC caches the outputs of the ops it is told to save; an output that a later op changes in place
(a batch norm's output fed to ``ReLU(inplace=True)``, a buffer ``bernoulli_`` fills) fails in
backward with "Tensor cached during selective activation checkpoint has been mutated". This module
runs the workload's forward once, without gradients, and records for every op whose output is
later written in place the op that writes it and the module each runs in. The model is restored
afterwards (buffers such as batch-norm running statistics are written back).

It is an analysis for the SAC panel's advice (no measurement): the panel greys those ops out and
says why before the user picks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_nb.checkpointing import COMPUTE_INTENSIVE_OPS, MATMUL_OPS, op_name


@dataclass(frozen=True)
class Unsavable:
    """An op (in ``module``) whose output ``consumer`` (in ``consumer_module``) changes in place."""

    op: str
    module: str
    consumer: str
    consumer_module: str

    def reason(self) -> str:
        where = f" in {self.consumer_module or '(model)'}" if self.consumer_module != self.module else ""
        return (
            f"its output is changed in place by {self.consumer}{where}; SAC cannot keep a tensor that is mutated later"
        )


class _InplaceWatch(TorchDispatchMode):
    def __init__(self, scope: list[str]):
        super().__init__()
        self.scope = scope
        self.producer: dict[int, tuple[str, str]] = {}  # id(storage) -> (op, module)
        self._alive: list[Any] = []  # keep storages alive so ids stay unique
        self.found: list[Unsavable] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        module = self.scope[-1] if self.scope else ""
        name = op_name(func)
        schema = getattr(func, "_schema", None)
        if schema is not None:
            flat = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
            for arg, value in zip(schema.arguments, flat):
                info = arg.alias_info
                if info is None or not info.is_write or not isinstance(value, torch.Tensor):
                    continue
                made = self.producer.get(id(value.untyped_storage()))
                if made is not None and made[0] != name:
                    self.found.append(Unsavable(made[0], made[1], name, module))
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if id(st) not in self.producer:
                    self.producer[id(st)] = (name, module)
                    self._alive.append(st)
        return out


def unsavable_ops(workload: Any) -> list[Unsavable]:
    """Ops whose outputs a later op writes in place, from one forward of ``workload`` without
    gradients (the model is left as it was)."""
    model = workload.model
    scope: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    handles = []

    def enter(mod: Any, _args: Any) -> None:
        scope.append(names.get(id(mod), ""))

    def leave(_mod: Any, _args: Any, _out: Any) -> None:
        if scope:
            scope.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    watch = _InplaceWatch(scope)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]  # running statistics move in train mode
    try:
        with torch.no_grad():
            batch = workload.make_batch()
            with watch:
                workload.forward(batch)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    unique: dict[tuple[str, str], Unsavable] = {}
    for u in watch.found:
        unique.setdefault((u.module, u.op), u)
    return list(unique.values())


def unsavable_in(found: list[Unsavable], region: str) -> dict[str, str]:
    """``{op: reason}`` for the ops made inside module ``region`` (or below it)."""
    out: dict[str, str] = {}
    for u in found:
        if region == "" or u.module == region or u.module.startswith(region + "."):
            out.setdefault(u.op, u.reason())
    return out


def preset_advice(ops: list[str]) -> str:
    """A sentence when a region's op list makes two presets the same (no matmuls on a CNN)."""
    have = set(ops)
    if have and not have & set(MATMUL_OPS):
        intensive = sorted(have & set(COMPUTE_INTENSIVE_OPS))
        if intensive:
            return (
                f"No matrix multiplications run in this region, so 'save matmuls' keeps nothing and equals "
                f"'full checkpoint'; 'save compute-intensive' keeps {', '.join(intensive)}."
            )
        return (
            "No matrix multiplications or convolutions run in this region: 'save matmuls' and "
            "'save compute-intensive' both equal 'full checkpoint' here."
        )
    return ""
