"""Measure a deep model at two shallow depths and extrapolate per block.

A decoder's blocks are alike: each adds the same parameter shards, optimizer state, gradients and
saved activations per rank, while what is not per block (the embedding, the head, the gathered
parameters and collective buffers in flight, the largest temporaries) stays the same. So a
per-rank peak at depth D is ``peak(a) + (D - a) * (peak(b) - peak(a)) / (b - a)``, exactly, once
both depths hold interior blocks: measured on Llama-3.1-70B at 16 ranks (FSDP2, TP 8 x FSDP2 2, with
and without checkpointing), depths 3, 4 and 5 lie on one line and depths 3 and 4 extrapolate to the
80-layer measurement to the byte. Depth 2 does not (its last block's backward prefetches nothing):
the planner measures at 3 and 4.

The shallow model shares the user's modules: only the module dicts on the path to the block list
are copied, so the user's model is never changed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from memsave_nb.checkpointing import suggest_regions

__all__ = ["Blocks", "blocks_of", "extrapolate", "SHALLOW_DEPTHS"]

SHALLOW_DEPTHS = (3, 4)


@dataclass(frozen=True)
class Blocks:
    """The model's repeated blocks: the list that holds them and how many there are."""

    list_name: str  # e.g. "model.layers"
    depth: int
    names: tuple[str, ...]

    @property
    def shallow(self) -> bool:
        """Deep enough that two shallow depths are cheaper than the whole model."""
        return bool(self.list_name) and self.depth > SHALLOW_DEPTHS[-1]


def blocks_of(model: nn.Module) -> Blocks:
    """The one block list a depth can be cut from (none when the blocks sit in several lists)."""
    names = suggest_regions(model)
    parents = {n.rpartition(".")[0] for n in names}
    if len(parents) != 1 or not names:
        return Blocks("", len(names), tuple(names))
    return Blocks(parents.pop(), len(names), tuple(names))


def at_depth(model: nn.Module, blocks: Blocks, depth: int) -> nn.Module:
    """``model`` with only its first ``depth`` blocks: a new module tree along the path to the
    block list, every other module shared (the user's model is not changed)."""
    path = blocks.list_name.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    new, old = root, model
    for part in path[:-1]:
        below = old._modules[part]
        assert below is not None  # a module on the path to the block list
        child = copy.copy(below)
        child._modules = dict(below._modules)
        new._modules[part] = child
        new, old = child, below
    full: Any = old._modules[path[-1]]  # the block list (ModuleList, Sequential): iterable, built from a list
    new._modules[path[-1]] = type(full)(list(full)[:depth])
    return root


def extrapolate(
    model: nn.Module, blocks: Blocks, run: Callable[[nn.Module, tuple[str, ...]], dict[str, float]], stages: int = 1
) -> dict[str, float]:
    """``run(model, block_names)`` gives numbers (peak, split, seconds) for one model; the same numbers
    for the whole depth, from two shallow depths when the model is deep, else from the model itself.
    ``stages``: pipeline stages the blocks are split over evenly; each stage is cut to 3 and 4 blocks
    (the model to ``3 * stages`` and ``4 * stages``), so each stage's blocks extrapolate as one model's."""
    da, db = (d * stages for d in SHALLOW_DEPTHS)
    if not blocks.list_name or blocks.depth <= db:
        return run(model, blocks.names)
    prefix = blocks.list_name + "."
    a = run(at_depth(model, blocks, da), tuple(f"{prefix}{i}" for i in range(da)))
    b = run(at_depth(model, blocks, db), tuple(f"{prefix}{i}" for i in range(db)))
    return linear(a, b, da, db, blocks.depth)


def linear(a: dict[str, float], b: dict[str, float], da: int, db: int, depth: int) -> dict[str, float]:
    """Per key: the line through (da, a) and (db, b), read at ``depth``."""
    keys = set(a) | set(b)
    return {k: a.get(k, 0.0) + (depth - da) * (b.get(k, 0.0) - a.get(k, 0.0)) / (db - da) for k in keys}
