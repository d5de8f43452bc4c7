"""The layout search's arguments checked, each in one line before anything is built, and the
micro-batch sizes a rank's batch splits into (by count, never one trial per sample)."""

from __future__ import annotations

from typing import Any

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.parallel_spec import MAX_MICROBATCHES
from memsave_nb.planner.links import Fabric, fabric_for
from memsave_nb.planner.pp import PP_DEGREES

TP_DEGREES = (1, 2, 4, 8)
# 16M sequences a step: far beyond any published pre-training batch (millions of tokens, thousands of sequences)
MAX_GLOBAL_BATCH = 1 << 24


def _check(gpus: Any, tensor_parallel: Any, fabric: Fabric, explicit_tp: bool) -> list[int]:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 1 << 16:
        raise PlanError(f"gpus must be a whole number in [1, 65536], got {show(gpus)}")
    if (
        isinstance(tensor_parallel, (str, bytes))
        or not isinstance(tensor_parallel, (list, tuple))
        or not tensor_parallel
    ):
        raise PlanError(f"tensor_parallel must be a list of degrees, got {show(tensor_parallel)}")
    out = []
    for tp in tensor_parallel:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise PlanError(f"tensor_parallel degrees are whole numbers >= 1, got {show(tp)}")
        if gpus % tp or tp > fabric.gpus_per_node:
            if explicit_tp:
                why = (
                    f"{gpus} GPUs are not divisible by it"
                    if gpus % tp
                    else f"it spans more than a node of {fabric.gpus_per_node}"
                )
                raise PlanError(f"tensor_parallel {tp}: {why}")
            continue
        out.append(tp)
    return list(dict.fromkeys(out))


def check_layout_args(gpus: Any, gpu: Any, tensor_parallel: Any = None) -> list[int]:
    """The GPU count, kind and TP degrees, checked in one line each before anything is built; the
    TP degrees to search (the defaults that do not divide ``gpus`` within a node are left out)."""
    if not isinstance(gpu, str) or gpu not in _gpu_names():
        raise PlanError(f"gpu {show(gpu)}: choose one of {', '.join(_gpu_names())}")
    explicit = tensor_parallel is not None
    return _check(gpus, TP_DEGREES if not explicit else tensor_parallel, fabric_for(gpu), explicit)


def micro_batches(per_rank: int, most: int) -> list[int]:
    """The micro-batch sizes that split ``per_rank`` evenly into at most ``most`` micro-batches,
    smallest first: one trial per micro-batch count, never one per sample."""
    return [per_rank // k for k in range(min(most, per_rank), 0, -1) if per_rank % k == 0]


def check_stage_counts(pipeline_parallel: Any) -> list[int]:
    """The pipeline stage counts to search (default ``PP_DEGREES``), duplicates dropped."""
    pps = PP_DEGREES if pipeline_parallel is None else pipeline_parallel
    if (
        isinstance(pps, (str, bytes))
        or not isinstance(pps, (list, tuple))
        or not pps
        or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in pps)
    ):
        raise PlanError(f"pipeline_parallel must be a list of stage counts >= 1, got {show(pipeline_parallel)}")
    return list(dict.fromkeys(pps))


def check_batches(global_batch: Any, max_micro_batches: Any) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise PlanError(f"global_batch must be a whole number in [1, {MAX_GLOBAL_BATCH}], got {show(global_batch)}")
    if (
        isinstance(max_micro_batches, bool)
        or not isinstance(max_micro_batches, int)
        or not 1 <= max_micro_batches <= MAX_MICROBATCHES
    ):
        raise PlanError(
            f"max_micro_batches must be a whole number in [1, {MAX_MICROBATCHES}], got {show(max_micro_batches)}"
        )


def _gpu_names() -> list[str]:
    from memsave_nb.planner.links import FABRICS
    from memsave_nb.planner.roofline import GPUS

    return [g for g in GPUS if g in FABRICS]
