"""The layout search's candidates before anything is measured: every ``ParallelSpec`` a GPU count
allows, and the groups (layout, checkpointing kind, precision, micro-batch sizes) the search
measures, each group once. Nothing here runs a step."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.planner.layout_args import micro_batches
from memsave_nb.planner.links import Fabric
from memsave_nb.vocabulary import SEARCHED_REGION_KINDS

__all__ = ["REGION_KINDS", "Group", "layout_specs", "groups_for", "ways"]

# None (no checkpointing) and the single-GPU planner's kinds but "offload", most saving first: the
# per-rank fake run does not size host copies of saved activations
REGION_KINDS: tuple[str | None, ...] = (None, *(k for k in SEARCHED_REGION_KINDS if k != "offload"))


class Group(NamedTuple):
    """One layout with one checkpointing kind and precision: measured once, every micro-batch from it."""

    spec: ParallelSpec
    kind: str | None
    precision: str | None
    mbs: list[int]  # the micro-batch sizes the rank's batch splits into, smallest first
    per_rank: int  # sequences per data-parallel rank and optimizer step


def layout_specs(gpus: int, fabric: Fabric, tps: Sequence[int]) -> list[ParallelSpec]:
    """Every spec searched but pipeline stages (``pp.pipeline_specs``)."""
    specs: list[ParallelSpec] = []
    if 1 in tps:
        specs.append(ParallelSpec(world_size=gpus, strategy="ddp"))
        specs.append(ParallelSpec(world_size=gpus))
        if gpus > 1:
            specs.append(ParallelSpec(world_size=gpus, reshard_after_forward=False))
            specs.append(ParallelSpec(world_size=gpus, cpu_offload=True))
        nodes = gpus // fabric.gpus_per_node
        if nodes > 1 and gpus % fabric.gpus_per_node == 0:  # HSDP: shard within a node, replicate across
            specs.append(ParallelSpec(world_size=gpus, replicate=nodes))
    for tp in tps:
        if tp > 1:
            specs.append(ParallelSpec(world_size=gpus, tensor_parallel=tp))
    return specs


def ways(spec: ParallelSpec) -> int:
    """Ranks one copy of the parameters is split over (FSDP2 shards x TP x pipeline stages)."""
    return spec.shard_size * spec.tensor_parallel * spec.pipeline_parallel if spec.strategy == "fsdp" else 1


def _most_saving_first(kind: str | None) -> int:
    return len(REGION_KINDS) if kind is None else REGION_KINDS.index(kind)


def groups_for(
    specs: Sequence[ParallelSpec],
    global_batch: int,
    max_micro_batches: int,
    region_kinds: Sequence[str | None],
    precisions: Sequence[str | None],
    notes: list[str],
) -> list[Group]:
    """The groups to measure, each layout's most memory-saving kind first; a layout the global batch
    does not split over is left out with a note."""
    groups: list[Group] = []
    for spec in specs:
        dp = spec.data_parallel
        if global_batch % dp:
            notes.append(f"{spec.describe()}: global batch {global_batch} does not split over {dp} data-parallel ranks")
            continue
        per_rank = global_batch // dp
        mbs = micro_batches(per_rank, max_micro_batches)
        if spec.pipeline_parallel > 1 and mbs:  # the most micro-batches (pp.py); 1F1B wants one per stage
            if per_rank // mbs[0] < spec.pipeline_parallel:
                notes.append(f"PP {spec.pipeline_parallel}: {per_rank} per rank makes fewer micro-batches than stages")
                continue
            spec, mbs = dataclasses.replace(spec, microbatches=per_rank // mbs[0]), mbs[:1]
        if not mbs:
            notes.append(f"{spec.describe()}: {per_rank} per rank needs more than {max_micro_batches} micro-batches")
            continue
        for precision in precisions:
            for kind in sorted(region_kinds, key=_most_saving_first):
                groups.append(Group(spec, kind, precision, mbs, per_rank))
    return groups
