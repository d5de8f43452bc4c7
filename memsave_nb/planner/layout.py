"""The layout planner: N GPUs of a named kind and a per-GPU target; which way to spread the
training step over them (DDP, FSDP2 with or without resharding, HSDP, FSDP2 with CPU offload,
tensor parallel x FSDP2), with which single-device choices (checkpointed blocks, precision,
micro-batches), ranked by estimated step time. See docs/planner.md, "Layouts".

How it searches, cheapest first:

1. Layouts: every ``ParallelSpec`` the GPU count allows (TP degrees within a node and dividing the
   count; pipeline stages x FSDP2 where the stages split the blocks evenly, ``pp.py``: 1F1B at the
   most micro-batches, measured by ``measure_pipeline`` on its first and last stage, the
   schedule's bubble in the time, the sends over the links).
2. A lower bound per layout, no step run: parameter, gradient and (Adam/SGD) optimizer bytes per
   rank, the blocks' saved activations per TP rank under each checkpointing kind (single-device
   shallow measurements). A layout whose bound is over the target is dropped, unmeasured.
3. Each surviving (layout, checkpointing kind, precision) is measured once per rank with
   ``measure_parallel`` in fake mode, at a micro-batch of 1, on the model cut to 3 and 4 blocks and
   extrapolated to its depth (``depth.py``: exact on the models tried). Larger micro-batches scale
   the batch-dependent part (activations, inputs, temporaries); accumulation adds the gradients
   held across micro-batches.
4. Time per candidate: the roofline per op (``cost.step_cost``, a fake pass at the micro-batch,
   extrapolated the same way) divided over TP ranks, plus the recomputation, plus communication:
   the payloads of the collectives the per-rank fake run recorded, times the ring factors, over the
   stated link bandwidths (``links.py``; the standard sizes before a layout is measured). Data-parallel
   collectives overlap compute (FSDP2 prefetches, DDP buckets): only what exceeds the compute is
   added; TP's and the offload's transfers are on the critical path and always added.
5. The Pareto front (estimated peak vs time). The fastest candidates that fit are checked in
   order with a shallow measurement at their own micro-batch until one fits: that is the chosen
   layout; ``remeasure=True`` measures it per rank at full depth with ``measure_parallel``.

The files, one job each: ``layout_specs.py`` (the layouts and groups, step 1), ``layout_measure.py``
(sizes and the cached shallow measurements, steps 2-3), ``layout_estimate.py`` (bound, peak, time,
steps 2-4), ``layout_rank.py`` (what is measured in which order, the ranking, the front, the choice,
step 5), ``layout_cache.py`` (measurements kept for the next search of the same step), this file
(the arguments, the order of the steps, the re-measurement).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import Blocks, blocks_of
from memsave_nb.planner.layout_args import TP_DEGREES, check_batches, check_layout_args, check_stage_counts
from memsave_nb.planner.layout_cache import store_for
from memsave_nb.planner.layout_estimate import LayoutSearch
from memsave_nb.planner.layout_measure import Measured, RankSizes
from memsave_nb.planner.layout_rank import choose, rank, search_groups
from memsave_nb.planner.layout_result import LayoutCandidate, LayoutResult
from memsave_nb.planner.layout_specs import REGION_KINDS, groups_for, layout_specs
from memsave_nb.planner.links import fabric_for
from memsave_nb.planner.pp import PP_DEGREES, pipeline_specs
from memsave_nb.planner.roofline import device_named
from memsave_nb.planner.start_plan import blocks_alike, start_from
from memsave_nb.target import Target

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.parallel.result import ParallelMeasurement
    from memsave_nb.workload import Workload

__all__ = [
    "LayoutCandidate",
    "LayoutResult",
    "check_layout_args",
    "plan_layout",
    "TP_DEGREES",
    "PP_DEGREES",
    "REGION_KINDS",
]


def plan_layout(
    workload: "Workload",
    gpus: int,
    gpu: str = "H100",
    target: Target | None = None,
    *,
    global_batch: int | None = None,
    tensor_parallel: Sequence[int] | None = None,
    pipeline_parallel: Sequence[int] | None = None,
    region_kinds: Sequence[str | None] = REGION_KINDS,
    precisions: Sequence[str | None] = (None,),
    max_micro_batches: int = 8,
    overlap: bool = True,
    remeasure: bool = True,
    check: int = 3,
    plan: Plan | None = None,
    reuse: bool = True,
) -> LayoutResult:
    """Search layouts of ``workload`` over ``gpus`` GPUs of kind ``gpu`` (a name in
    ``roofline.GPUS``) under ``target`` (default: the GPU's memory, 80% headroom); see the module
    doc. ``global_batch`` (default: the workload's batch x ``gpus``) is split over the data-parallel
    ranks and then into micro-batches (at most ``max_micro_batches``). ``tensor_parallel`` lists
    the TP degrees (default 1, 2, 4, 8 where they divide ``gpus`` within a node; a given degree
    that does not is an error). ``pipeline_parallel``: the stage counts (default: 2, 4, 8 only if nothing
    without stages fits; those that do not split the GPUs and the blocks evenly are left out, with
    a note). ``check``: how many of the fastest fitting candidates may be
    checked by a shallow measurement before giving up. The workload's freezing (LoRA included) is
    kept as given, and so are ``plan``'s choices (``start_plan.py``: its freezing, layers, loss,
    optimizer; its checkpointing and precision when set, else searched; its batch per GPU).
    ``reuse``: take what an earlier search of the same step measured (``layout_cache.py``; the
    same answer, sooner); False measures everything afresh."""
    start = time.process_time()
    tps = check_layout_args(gpus, gpu, tensor_parallel)
    pps = check_stage_counts(pipeline_parallel)
    device, fabric = device_named(gpu), fabric_for(gpu)
    target = target if target is not None else Target(device.memory_gb, name=f"{device.name} ({device.memory_gb:g} GB)")
    if not isinstance(target, Target):
        raise PlanError(f"target must be a Target (e.g. Target(80)), got {show(target)}")
    for kind in region_kinds:
        if kind not in REGION_KINDS:
            raise PlanError(f"region kind {show(kind)}: choose from {REGION_KINDS}")
    for precision in precisions:
        if precision is not None:
            Plan(precision=precision)  # one line naming a bad precision
    from memsave_nb.knobs import batch_size_of
    from memsave_nb.target import _raw_batch

    blocks = blocks_of(workload.model)
    start_plan = start_from(plan, blocks, region_kinds, precisions)
    region_kinds, precisions = start_plan.region_kinds, start_plan.precisions
    if plan is not None:
        plan.validate(workload.model)
    per_gpu = start_plan.per_gpu_batch or batch_size_of(_raw_batch(workload))
    global_batch = per_gpu * gpus if global_batch is None else global_batch
    check_batches(global_batch, max_micro_batches)
    unlike = not blocks_alike(start_plan.plan, workload.model, blocks)
    if unlike:  # the plan treats blocks differently: the shallow cuts do not stand for the model
        blocks = Blocks("", blocks.depth, blocks.names)
    store = store_for(workload, start_plan, blocks) if reuse else Measured()
    sizes = RankSizes(workload, blocks, device, start_plan, store)
    search = LayoutSearch(sizes, fabric, target, global_batch, overlap)
    notes = search.notes
    if start_plan.words:
        notes.append(f"starts from the plan: {start_plan.words}")
    notes.append(
        "communication: the payloads of the collectives each per-rank fake run recorded, times the "
        "ring factors, over the stated links; before a layout is measured (to decide whether to) and "
        "for CPU offload's copies, the standard sizes"
    )
    if not blocks.names:
        region_kinds = (None,)
        notes.append("no repeated blocks: no checkpointing searched")
    elif unlike:
        notes.append("measured at full depth (the plan treats some blocks differently from others)")
    elif not blocks.shallow:
        notes.append("measured at full depth (no single list of more than 4 repeated blocks to extrapolate from)")

    def groups(specs):
        return groups_for(specs, global_batch, max_micro_batches, region_kinds, precisions, notes)

    pp_specs, pp_notes = pipeline_specs(gpus, workload.model, blocks, pps, tps)
    notes += pp_notes
    flat = layout_specs(gpus, fabric, tps) if 1 in pps else []
    if pipeline_parallel is None and flat:
        # Stages only where nothing without them fits (they pay the bubble; the 70B on 16 GPUs: 105 s
        # of search instead of 34, same choice); asked for by name, they are always searched.
        candidates, pruned = search_groups(search, groups(flat))
        if any(c.fits for c in candidates):
            if pp_specs:
                notes.append(
                    "pipeline stages not searched: a layout without them fits "
                    "(pipeline_parallel=(1, 2, 4, 8) or --pp 1,2,4,8 compares them)"
                )
        else:
            more, more_pruned = search_groups(search, groups(pp_specs))
            candidates, pruned = candidates + more, pruned + more_pruned
    else:
        candidates, pruned = search_groups(search, groups(flat + pp_specs))
    ranked, front = rank(candidates)
    chosen = choose(search, ranked, check)
    remeasured, remeasure_seconds = None, 0.0
    if chosen is not None and remeasure:
        begin = time.process_time()
        remeasured = _remeasure(workload, chosen, store)
        remeasure_seconds = time.process_time() - begin
    total = time.process_time() - start
    return LayoutResult(
        gpus=gpus,
        device=device,
        fabric=fabric,
        target=target,
        global_batch=global_batch,
        candidates=ranked,
        front=front,
        chosen=chosen,
        remeasured=remeasured,
        pruned=pruned,
        notes=notes,
        cpu_seconds=total,
        measurements=sizes.measurements,
        search_cpu_seconds=total - remeasure_seconds,
        remeasure_cpu_seconds=remeasure_seconds,
    )


def _remeasure(workload: "Workload", chosen: LayoutCandidate, store: Measured) -> "ParallelMeasurement":
    """The chosen layout per rank at full depth (every stage under pipeline stages); kept in ``store``."""
    # from the second micro-batch on the peak no longer changes: two stand for any number
    k = min(chosen.accumulation, 2)
    plan = chosen.plan if chosen.pipeline_stages > 1 else chosen.plan.replace(accumulation_steps=k if k > 1 else None)
    key = (chosen.spec, plan.to_json())
    if key not in store.full:
        from memsave_nb.parallel import measure_parallel, measure_pipeline

        if chosen.pipeline_stages > 1:
            store.full[key] = measure_pipeline(workload, chosen.spec, plan)
        else:
            store.full[key] = measure_parallel(workload, chosen.spec, plan)
    return store.full[key]
