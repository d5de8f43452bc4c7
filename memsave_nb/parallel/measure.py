"""``measure_parallel``: per-rank peaks in fake mode, one process, PyTorch's own FSDP2/DDP code.

DDP runs with two fake-backend changes (``ddp.py``); FSDP2 builds only the parameter chunk each
rank keeps (``apply._LazyChunks``, the same views); neither changes a byte.

For each group of ranks with equal shard shapes (``apply.rank_layouts``), one rank is measured:
a fake process group for that rank and its mesh (outside fake mode); under ``FakeTensorMode`` a
fake twin of the model, the plan's choices on the twin, ``fully_shard``/DDP, the batch, the
optimizer and the tracked step. Everything is torn down afterwards; the user's model is never
touched and ``torch.distributed.is_initialized()`` is as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Sequence

import torch

from ..errors import MemsaveError
from ..measure.cuda_attention import sized_attention
from ..measure.fake_compat import optimizer_numbers
from ..measure.fake_dispatch import quick_dispatch
from ..workload import Workload, map_tensors
from .apply import apply_parallel, rank_layouts
from .process_group import fake_process_group
from .result import ParallelMeasurement, RankMeasurement, unseen_lines
from ..parallel_spec import ParallelError, ParallelSpec
from .step import tracked_step
from .twin import fake_twin


def measure_parallel(
    workload: Workload,
    spec: ParallelSpec | None = None,
    plan: Any = None,
    *,
    ranks: Sequence[int] | None = None,
    steady: bool = True,
    replay: bool = True,
) -> ParallelMeasurement:
    """Per-rank peak and split of one training step of ``workload`` under ``spec``.

    ``plan`` (a ``memsave_nb.Plan``) is applied to the twin first: freezing, memory-saving layers,
    checkpointed regions. ``ranks``: which ranks to measure; by default one of each shard layout,
    which includes the worst rank. ``steady``: measure step 2 (optimizer state alive). ``replay``:
    replay each rank's step through the caching-allocator model (``replay.py``; False: the 80% rule
    judges it, as the layout search's shallow twins, whose steps no GPU runs).
    ``spec`` defaults to ``plan.parallel``.
    """
    if spec is None:
        spec = getattr(plan, "parallel", None)
        if spec is None:
            raise ParallelError("no parallel spec: pass spec=ParallelSpec(...) or a plan with parallel=...")
    if plan is not None and getattr(plan, "compile_budget", None) is not None:
        raise ParallelError("a compile budget cannot be sized per rank in fake mode (fake tensors do not compile)")
    _check_optimizer(workload, spec, plan)
    layouts = rank_layouts(workload.model, spec)
    if isinstance(spec, ParallelSpec) and spec.pipeline_parallel > 1:  # its pp dim was sharded as HSDP's replicas
        if spec.tensor_parallel > 1:  # the model's own refusal first (heads TP cannot split)
            from .tp import resolve_tp_plan

            resolve_tp_plan(workload.model, spec)
        raise ParallelError(
            f"pipeline_parallel={spec.pipeline_parallel}: size pipeline stages with measure_pipeline(workload, spec, plan)"
        )
    if ranks is None:
        chosen = [(g[0], g) for g in layouts]
    else:
        by_rank = {r: g for g in layouts for r in g}
        chosen = []
        for r in ranks:
            if r not in by_rank:
                raise ParallelError(f"rank {r} is outside world size {spec.world_size}")
            chosen.append((r, (r,)))
    results = tuple(
        measure_rank(workload, spec, plan, rank=r, ranks=g, steady=steady, replay=replay) for r, g in chosen
    )
    worst = max(results, key=lambda r: (r.device_bytes, r.peak_bytes, -r.rank))
    unseen = unseen_lines(
        spec,
        worst.device_bytes,
        max(r.offload_h2d_bytes for r in results),
        max(r.offload_d2h_bytes for r in results),
        max(r.foreach_temp_bytes for r in results),
        None if worst.reserved is None else worst.reserved.max_reserved_bytes,
    )
    return ParallelMeasurement(
        spec=spec, ranks=results, steady=steady, plan_name=getattr(plan, "name", "") or "", unseen=unseen
    )


def _check_optimizer(workload: Workload, spec: ParallelSpec, plan: Any) -> None:
    """Refuse, in one line, an optimizer that cannot step the strategy's parameters."""
    name = getattr(plan, "optimizer", None) or workload.optimizer
    if spec.strategy == "fsdp" and isinstance(name, str) and name.lower() == "adafactor":
        raise ParallelError(
            "optimizer adafactor: torch.optim.Adafactor cannot step FSDP2's sharded (DTensor) parameters "
            "(its factored update runs an in-place op DTensor refuses); size it with strategy 'ddp' or another optimizer"
        )


def _rank_error(rank: int, exc: BaseException) -> ParallelError:
    """A step that failed on a rank, in one line (the cause is kept on the exception)."""
    from ..checkpointing import show

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    hint = ""
    if "mixed torch.Tensor and DTensor" in first:  # a real run raises the same: say why and what to change
        hint = (
            " (with tensor parallel over every rank and no FSDP2, the parameters outside the TP plan, e.g. the "
            "norms, stay plain tensors, and a foreach optimizer cannot step them with the DTensors; PyTorch "
            "raises this in a real run too: turn sequence_parallel on, shard with FSDP2 over 2+ ranks, or use "
            "foreach=False)"
        )
    return ParallelError(f"rank {rank}: the step failed: {type(exc).__name__}: {show(first, 200)[1:-1]}{hint}")


# One default process group per process: measurements from several threads (the explorer's GPUs
# panel re-sizes on a worker thread) take turns.
_PROCESS_GROUP_LOCK = threading.RLock()


def measure_rank(
    workload: Workload,
    spec: ParallelSpec,
    plan: Any = None,
    *,
    rank: int = 0,
    ranks: tuple[int, ...] | None = None,
    steady: bool = True,
    replay: bool = True,
) -> RankMeasurement:
    """One rank in fake mode (see ``measure_parallel``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Tensor parallel: FSDP2 x TP cannot be set up inside fake mode (the mesh's _concatenate runs
    # nonzero), so the twin is built on meta, sharded outside fake mode and to_empty'd inside it.
    # DTensor's cold-cache sharding propagation is ignored by the tracker, so the cheap warm-up
    # (optimizer state on zero gradients) gives the bytes of a whole first step here too (tested).
    tp = spec.tensor_parallel > 1
    waits: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if tp:
        from .tp import clear_dtensor_caches, waits_return_their_tensor

        clear_dtensor_caches()  # no mesh of an earlier (destroyed) group may come back from them
        waits = waits_return_their_tensor()
    with _PROCESS_GROUP_LOCK, fake_process_group(spec, rank) as mesh:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        twin = fake_twin(workload.model, fake_mode, meta=tp)
        twin_workload = workload.replace(model=twin)
        applied = plan.apply(twin_workload) if plan is not None else contextlib.nullcontext(twin_workload)
        # The plan restores the twin on exit by comparing its parameter dicts: put back the
        # twin's own tensors first (fully_shard swapped in DTensors), then the plan undoes the rest.
        with applied as wl, entries_restored(wl.model):
            with contextlib.nullcontext() if tp else fake_mode:
                called = apply_parallel(wl.model, spec, mesh, fake=True)
            # a step sized for CUDA runs the SDPA kernel CUDA would pick on ``workload.gpu``, as the engine's
            with quick_dispatch(fake_mode), fake_mode, waits, sized_attention(wl) as attention:
                if tp:
                    wl.model.to_empty(device="cpu")
                batch = _fake_batch(wl, fake_mode)
                # an optimizer that reads a scalar (Adafactor's step count) gets the single-device answer
                try:
                    with optimizer_numbers():
                        result = tracked_step(
                            wl, called, batch, rank=rank, ranks=ranks or (rank,), steady=steady, replay=replay
                        )
                    if attention is not None and attention.backends:
                        result = dataclasses.replace(
                            result, attention_backends=tuple(sorted(attention.backends.items()))
                        )
                    return result
                except (MemsaveError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # noqa: BLE001 - one line, the cause kept
                    if spec.sequence_parallel and isinstance(exc, (RuntimeError, ValueError)):
                        raise _sequence_parallel_error(exc) from exc
                    raise _rank_error(rank, exc) from exc


def _sequence_parallel_error(exc: BaseException) -> ParallelError:
    """A forward that cannot run on sequence shards (a plain tensor, such as learned position
    embeddings, mixed into the sequence-sharded residual stream), in one line."""
    from ..checkpointing import show

    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ParallelError(
        f"sequence_parallel: the model's forward does not run on sequence shards ({show(first, 160)[1:-1]})"
    )


@contextlib.contextmanager
def entries_restored(model: torch.nn.Module):
    entries: list[tuple[dict[str, Any], str, Any]] = [
        (d, k, v) for m in model.modules() for d in (m._parameters, m._buffers) for k, v in d.items()
    ]
    try:
        yield
    finally:
        for d, k, v in entries:
            d[k] = v


def _fake_batch(workload: Workload, fake_mode) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    raw = workload.batch() if callable(workload.batch) else workload.batch
    converted = map_tensors(raw, lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t))
    return workload.replace(batch=converted).make_batch()
