"""The plan a layout search starts from (the explorer's current plan, or a caller's).

The layout planner searches the layout, the micro-batches and, unless the plan chose them, the
checkpointing and the precision. Every other choice of the plan is kept on every candidate, as
given: freezing (so fewer gradients and less optimizer state per rank), memory-saving layers,
batch-norm modes, the sequence length, the optimizer, ``set_to_none`` and the loss (chunked or
not). The plan's batch size times its accumulation steps is the per-GPU batch the global batch
is made of. Its checkpointing is kept when it checkpoints every block alike with a kind the
planner knows (``full``, ``save_matmuls``): the shallow measurements extrapolate over blocks
that are alike. A compile budget cannot be sized per rank in fake mode and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from memsave_nb.checkpointing import POLICY_PRESETS, PlanError, show
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import Blocks

__all__ = ["StartPlan", "blocks_alike", "start_from"]


@dataclass(frozen=True)
class StartPlan:
    plan: Plan  # the kept choices: regions, precision, batch, accumulation and parallel cleared
    region_kinds: tuple[str | None, ...]
    precisions: tuple[str | None, ...]
    per_gpu_batch: int | None  # the plan's batch size x accumulation steps (None: the workload's batch)
    words: str  # what the search keeps from the plan, in words ("" for an empty plan)

    def with_choices(self, regions: dict, precision: str | None, batch_size: int, accumulation: int, spec) -> Plan:
        """The kept choices plus one candidate's own."""
        return self.plan.replace(
            regions=regions,
            precision=precision,
            batch_size=batch_size,
            accumulation_steps=accumulation if accumulation > 1 else None,
            parallel=spec,
        )


def start_from(
    plan: Plan | None, blocks: Blocks, region_kinds: Sequence[str | None], precisions: Sequence[str | None]
) -> StartPlan:
    """What the search keeps from ``plan`` and which kinds and precisions it still searches."""
    if plan is None:
        return StartPlan(Plan(), tuple(region_kinds), tuple(precisions), None, "")
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a memsave_nb.Plan, got {show(plan)}")
    if plan.compile_budget is not None:
        raise PlanError("the plan's compile budget cannot be sized per rank in fake mode: clear it to search layouts")
    kinds = tuple(region_kinds)
    regions = plan.active_regions
    if regions:
        kinds = (_uniform_kind(regions, blocks),)
    if plan.precision is not None:
        precisions = (plan.precision,)
    batch = plan.batch_size * (plan.accumulation_steps or 1) if plan.batch_size else None
    kept = plan.replace(regions={}, precision=None, batch_size=None, accumulation_steps=None, parallel=None)
    words = "" if kept.is_empty else kept.describe()  # not "baseline (no changes), batch 4 per GPU"
    if regions:
        words = ", ".join(w for w in (words, f"checkpoint {kinds[0]} blocks") if w)
    if plan.precision is not None:
        words = ", ".join(w for w in (words, plan.precision) if w)
    if batch is not None:
        words = ", ".join(w for w in (words, f"batch {batch} per GPU") if w)
    return StartPlan(kept, kinds, tuple(precisions), batch, words)


def _uniform_kind(regions: dict, blocks: Blocks) -> str:
    """The one checkpointing kind the plan puts on every block, or a one-line error."""
    known = {name: POLICY_PRESETS[name] for name in ("full", "save_matmuls")}
    every_block = set(regions) == set(blocks.names)
    kind = next((name for name, p in known.items() if every_block and all(v == p for v in regions.values())), None)
    if kind is None:
        raise PlanError(
            "the layout planner keeps a plan's checkpointing only when every block is checkpointed alike "
            "(full or save_matmuls); clear the plan's regions to let it choose"
        )
    return kind


def blocks_alike(plan: Plan, model, blocks: Blocks) -> bool:
    """Whether ``plan`` treats every block the same way (then the shallow cuts stand for the model):
    the same parameters train in each, and no choice names a single block."""
    if not blocks.shallow:
        return True
    prefix = blocks.list_name + "."
    for field_name in ("frozen", "trainable", "bn_eval", "memsave"):
        if any(name.startswith(prefix) and not any(c in name for c in "*?[") for name in getattr(plan, field_name)):
            return False
    if not (plan.frozen or plan.trainable):
        return True
    trains = plan.trainable_parameter_names(model)
    per_block = {frozenset(n[len(b) + 1 :] for n in trains if n.startswith(b + ".")) for b in blocks.names}
    return len(per_block) == 1
