"""The layout search's order and verdict: which groups are measured (each layout's most saving kind
always; the rest only where they could beat what already fits and their lower bound fits), the
ranking by step time, the Pareto front, and the chosen layout (the fastest whose own micro-batch,
measured, fits)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from memsave_nb.planner.layout_estimate import LayoutSearch
from memsave_nb.planner.layout_result import LayoutCandidate
from memsave_nb.planner.layout_specs import Group
from memsave_nb.planner.pareto import pareto_front
from memsave_nb.units import format_bytes

__all__ = ["search_groups", "rank", "choose"]


def search_groups(search: LayoutSearch, groups: Sequence[Group]) -> tuple[list[LayoutCandidate], list[str]]:
    """Measure each group (layout, checkpointing kind, precision) once, all micro-batches from it.

    Each layout's most memory-saving kind is measured (the front's low end); a less saving kind, and
    any pipeline layout, only when its fastest micro-batch could beat the fastest candidate found to
    fit (its time needs no measurement), when its lower bound fits, and when the layout's previous
    kind fitted somewhere."""
    candidates: list[LayoutCandidate] = []
    pruned: list[str] = []
    first_of: dict = {}
    for g in groups:
        first_of.setdefault((g.spec, g.precision), g.kind)
    dead: set = set()  # (spec, precision) whose more saving kind fitted nowhere

    def optimistic(g: Group) -> float:
        return min(search.timing(g.spec, g.kind, g.precision, mb, g.per_rank // mb).seconds for mb in g.mbs)

    # pipeline stages are measured only where they could beat what fits (their bubble and a
    # measurement over every micro-batch make them the dearest to measure)
    firsts = [g for g in groups if first_of[(g.spec, g.precision)] == g.kind and g.spec.pipeline_parallel == 1]
    rest = sorted((g for g in groups if g not in firsts and g.spec.pipeline_parallel == 1), key=optimistic)
    stages = [g for g in groups if g.spec.pipeline_parallel > 1]  # each layout's most saving kind first
    skipped = 0
    for g in firsts + rest + stages:
        spec, kind, precision, mbs, per_rank = g
        words = f"{spec.describe()}, {kind or 'no'} checkpointing"
        if (spec, precision) in dead:
            continue
        if g not in firsts:
            best = min((c.step_seconds for c in candidates if c.fits), default=float("inf"))
            if optimistic(g) >= best:
                skipped += 1
                continue
        bound = search.lower_bound(spec, kind, precision)
        if not search.target.fits(bound):
            pruned.append(f"{words}: at least {format_bytes(bound)} per GPU")
            dead.add((spec, precision))
            continue
        try:
            new = [search.candidate(spec, kind, precision, mb, per_rank // mb, mbs) for mb in mbs]
        except Exception as exc:  # noqa: BLE001 - a layout the model cannot take: a note, not the end
            search.notes.append(f"{words}: skipped ({' '.join(str(exc).split())[:160]})")
            dead.add((spec, precision))
            continue
        candidates += new
        if not any(c.fits for c in new):
            dead.add((spec, precision))
    if skipped:
        search.notes.append(
            f"{skipped} layout/checkpointing pairs not measured: even their fastest micro-batch is "
            "estimated slower than a candidate that fits (the front is over those measured)"
        )
    return candidates, pruned


def rank(candidates: Sequence[LayoutCandidate]) -> tuple[list[LayoutCandidate], list[LayoutCandidate]]:
    """Fastest first (then lowest peak), and the Pareto front of those that fit (peak vs time)."""
    ranked = sorted(candidates, key=lambda c: (c.step_seconds, c.est_peak_bytes))
    front = pareto_front([c for c in ranked if c.fits], key=lambda c: (c.est_peak_bytes, c.step_seconds))
    return ranked, front


def choose(search: LayoutSearch, ranked: Sequence[LayoutCandidate], check: int) -> LayoutCandidate | None:
    """The fastest candidate whose own micro-batch, measured (shallow, extrapolated), fits."""
    for c in [c for c in ranked if c.fits][: max(0, check)]:
        k = min(c.accumulation, 2)  # from the second micro-batch on the peak no longer changes
        peak = search.sizes.rank_split(c.spec, c.regions, c.precision, c.micro_batch, k)["peak"]
        if search.target.fits(peak):
            return dataclasses.replace(c, checked_peak_bytes=int(peak))
        search.notes.append(f"{c.label}: estimated to fit, measured {format_bytes(peak)} at its micro-batch; next")
    return None
