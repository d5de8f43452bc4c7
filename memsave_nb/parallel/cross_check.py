"""Your model on real ranks: the same step on a real gloo group, one CPU process per rank.

``cross_check(make_workload, spec)`` forks ``spec.world_size`` processes (fork: the ranks inherit
the imported torch and the factory, which need not be picklable). Each rank calls the factory
(it must build the same model and batch on every call: seed it), applies the same
``fully_shard`` / DDP / tensor-parallel calls as fake mode (``apply.apply_parallel``) or builds
its pipeline stage(s) and schedule (``pipeline.rank_step``), and runs the same tracked step on
real tensors with real collectives. Each rank's peak is compared with the fake-mode prediction
for that rank (``measure_rank`` / ``measure_pipeline``). The command line front door is
``python -m memsave_nb.cli.gloo`` (built-in cases by name).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..parallel_spec import ParallelSpec
from ..workload import Workload
from .result import RankMeasurement

WorkloadFactory = Callable[[], Workload]


@dataclass(frozen=True)
class CrossCheckRow:
    case: str
    world_size: int
    rank: int
    predicted_bytes: int
    measured_bytes: int
    predicted_split: dict
    measured_split: dict
    staging_bytes: int = 0  # gloo's own reduce-scatter copies (NCCL and the fake backend make none)
    measured_without_staging_bytes: int | None = None
    predicted_host_bytes: int | None = None  # CPU offload: host peaks (FSDP2's host storages, host.py)
    measured_host_bytes: int | None = None

    @property
    def comparable_bytes(self) -> int:
        """The measured peak without gloo's staging copies: what the prediction is for."""
        w = self.measured_without_staging_bytes
        return self.measured_bytes if w is None else w

    @property
    def difference_bytes(self) -> int:
        return self.comparable_bytes - self.predicted_bytes


def _rank_main(
    rank: int,
    factory: WorkloadFactory,
    spec_dict: dict,
    store_path: str,
    out_dir: str,
    plan_json: str | None,
    stages: Any,
) -> None:
    from .process_group import settle_forked_rank

    settle_forked_rank()  # inherited garbage may hold an earlier run's gloo group: never collect it here
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..plan import Plan
    from .apply import apply_parallel
    from .measure import entries_restored
    from .step import tracked_step

    torch.set_num_threads(1)
    spec = ParallelSpec.from_dict(spec_dict)
    if spec.tensor_parallel > 1:
        from .tp import clear_dtensor_caches

        clear_dtensor_caches()  # forked from a process that measured: its DTensor caches hold old meshes
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=spec.world_size)
    try:
        workload = factory()
        plan = Plan.from_json(plan_json) if plan_json else None
        with (
            plan.apply(workload) if plan is not None else contextlib.nullcontext(workload) as wl,
            entries_restored(wl.model),
        ):
            if spec.pipeline_parallel > 1:
                from .pipeline import _split, rank_step

                mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names)
                result = rank_step(
                    wl, spec, _split(wl.model, spec, stages), rank, wl.make_batch(), fake=False, mesh=mesh
                )
            else:
                mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names)
                called = apply_parallel(wl.model, spec, mesh)
                result = tracked_step(
                    wl,
                    called,
                    wl.make_batch(),
                    rank=rank,
                    ranks=(rank,),
                    steady="full" if spec.tensor_parallel > 1 else True,
                )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result.as_dict(), f)
    finally:
        dist.destroy_process_group()


def measure_gloo(
    factory: WorkloadFactory,
    spec: ParallelSpec,
    *,
    plan: Any = None,
    stages: Any = None,
    start_method: str = "fork",
    timeout_s: float = 600.0,
) -> list[RankMeasurement]:
    """Each rank's measured step on a real gloo group of ``spec.world_size`` CPU processes
    (``plan``, a ``memsave_nb.Plan``, applied to each rank's model first, as in fake mode)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args = (
            factory,
            spec.to_dict(),
            os.path.join(tmp, "store"),
            tmp,
            plan.to_json() if plan is not None else None,
            stages,
        )
        gc.collect()  # the ranks inherit no garbage the parent can still collect safely (see settle_forked_rank)
        ctx = mp.start_processes(_rank_main, args=args, nprocs=spec.world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for proc in ctx.processes:  # only the ranks started here
                    if proc.is_alive():
                        proc.terminate()
                raise TimeoutError(f"gloo ranks did not finish within {timeout_s:g} s")
        out = []
        for r in range(spec.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                d = json.load(f)
            out.append(
                RankMeasurement(
                    rank=d["rank"],
                    ranks=tuple(d["ranks"]),
                    peak_bytes=d["peak_bytes"],
                    peak_split=d["peak_split"],
                    peak_phase=d["peak_phase"],
                    saved_bytes=d["saved_bytes"],
                    end_split=d["end_split"],
                    events=0,
                    seconds=d["seconds"],
                    backend_staging_bytes=d["backend_staging_bytes"],
                    peak_without_staging_bytes=d["peak_without_staging_bytes"],
                    device_peak_bytes=d.get("device_peak_bytes"),
                    device_peak_split=d.get("device_peak_split"),
                    device_peak_phase=d.get("device_peak_phase", ""),
                    host_peak_bytes=d.get("host_peak_bytes"),
                )
            )
    return out


def cross_check(
    make_workload: WorkloadFactory,
    spec: ParallelSpec,
    plan: Any = None,
    *,
    stages: Any = None,
    name: str | None = None,
    timeout_s: float = 600.0,
) -> list[CrossCheckRow]:
    """Fake-mode prediction against the real gloo measurement, per rank, for your own model.

    ``make_workload``: a zero-argument callable returning the same (seeded) ``Workload`` on every
    call; it runs once here (the prediction) and once in each forked rank. ``stages``: the
    pipeline split, as for ``measure_pipeline``.
    """
    from .measure import measure_rank

    workload = make_workload()
    label = name or workload.name
    measured = measure_gloo(make_workload, spec, plan=plan, stages=stages, timeout_s=timeout_s)
    if spec.pipeline_parallel > 1:
        from .pipeline import measure_pipeline

        predicted = {r: m for m in measure_pipeline(workload, spec, plan, stages=stages).ranks for r in m.ranks}
    rows = []
    for m in measured:
        p = predicted[m.rank] if spec.pipeline_parallel > 1 else measure_rank(workload, spec, plan, rank=m.rank)
        rows.append(
            CrossCheckRow(
                label,
                spec.world_size,
                m.rank,
                p.peak_bytes,
                m.peak_bytes,
                p.peak_split,
                m.peak_split,
                m.backend_staging_bytes,
                m.peak_without_staging_bytes,
                p.host_peak_bytes,
                m.host_peak_bytes,
            )
        )
    return rows


def markdown_table(rows: list[CrossCheckRow]) -> str:
    host = any(r.predicted_host_bytes is not None for r in rows)
    extra_head, extra_rule = (" predicted host peak | measured host peak |", "---:|---:|") if host else ("", "")
    lines = [
        "| model | world size | rank | predicted (fake) | measured (gloo) | gloo staging copies (sum over the step) | "
        f"measured without them | difference |{extra_head}",
        f"|---|---:|---:|---:|---:|---:|---:|---:|{extra_rule}",
    ]
    for r in rows:
        extra = f" {r.predicted_host_bytes or 0:,} | {r.measured_host_bytes or 0:,} |" if host else ""
        lines.append(
            f"| {r.case} | {r.world_size} | {r.rank} | {r.predicted_bytes:,} | {r.measured_bytes:,} | "
            f"{r.staging_bytes:,} | {r.comparable_bytes:,} | {r.difference_bytes:+,} |{extra}"
        )
    return "\n".join(lines)
