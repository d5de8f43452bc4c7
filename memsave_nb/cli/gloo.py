"""The real cross-check: the same step on a real gloo process group, one process per rank.

Each rank (``torch.multiprocessing``, spawn) builds the workload from a named case with the same
seed, applies the same ``fully_shard``/DDP calls (``apply.apply_parallel``) to its real model, and
runs the same tracked step (``step.tracked_step``) on real tensors with real collectives. Its
peak and split are compared with the fake-mode prediction for that rank (``measure_rank``).

``python -m memsave_nb.cli.gloo --case tiny-gpt --world-size 2 4 [--ddp | --cpu-offload]`` prints the table.
Classic DDP runs here exactly as in a training script (its default all-reduce, ``init_sync``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..parallel.result import RankMeasurement
from ..parallel_spec import ParallelSpec


def _tiny_gpt():
    from .. import zoo

    cfg = zoo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
    return zoo.gpt(cfg, batch_size=2)


def _gpt():
    from .. import zoo

    return zoo.make("gpt")


def _mlp():
    from .. import zoo

    return zoo.make("mlp", batch_size=64)


CASES: dict[str, Callable[[], Any]] = {"tiny-gpt": _tiny_gpt, "gpt": _gpt, "mlp": _mlp}


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


def _rank_main(rank: int, case: str, spec_dict: dict, store_path: str, out_dir: str, plan_json: str | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..parallel.apply import apply_parallel
    from ..plan import Plan
    from ..parallel.measure import entries_restored
    from ..parallel.step import tracked_step

    torch.set_num_threads(1)
    spec = ParallelSpec.from_dict(spec_dict)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=spec.world_size)
    try:
        names = ("replicate", "shard") if len(spec.mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)
        workload = CASES[case]()
        plan = Plan.from_json(plan_json) if plan_json else None
        with (plan.apply(workload) if plan is not None else contextlib.nullcontext(workload)) as wl, \
                entries_restored(wl.model):
            called = apply_parallel(wl.model, spec, mesh)
            batch = wl.make_batch()
            result = tracked_step(wl, called, batch, rank=rank, ranks=(rank,), steady=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result.as_dict(), f)
    finally:
        dist.destroy_process_group()


def measure_gloo(case: str, spec: ParallelSpec, start_method: str = "fork",
                 timeout_s: float = 600.0, plan: Any = None) -> list[RankMeasurement]:
    """Each rank's measured step on a real gloo group of ``spec.world_size`` CPU processes
    (``plan``, a ``memsave_nb.Plan``, applied to each rank's model first, as in fake mode)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        # fork: the ranks inherit the imported torch (spawn re-imports it per rank, ~10 s each here)
        ctx = mp.start_processes(_rank_main, args=(case, spec.to_dict(), os.path.join(tmp, "store"), tmp,
                                                           plan.to_json() if plan is not None else None),
                                 nprocs=spec.world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for proc in ctx.processes:  # only the ranks started here
                    if proc.is_alive():
                        proc.terminate()
                raise TimeoutError(f"gloo ranks of {case!r} did not finish within {timeout_s:g} s")
        out = []
        for r in range(spec.world_size):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                d = json.load(f)
            out.append(RankMeasurement(rank=d["rank"], ranks=tuple(d["ranks"]), peak_bytes=d["peak_bytes"],
                                       peak_split=d["peak_split"], peak_phase=d["peak_phase"], saved_bytes=d["saved_bytes"],
                                       end_split=d["end_split"], events=0, seconds=d["seconds"],
                                       backend_staging_bytes=d["backend_staging_bytes"],
                                       peak_without_staging_bytes=d["peak_without_staging_bytes"],
                                       device_peak_bytes=d.get("device_peak_bytes"),
                                       device_peak_split=d.get("device_peak_split"),
                                       device_peak_phase=d.get("device_peak_phase", ""),
                                       host_peak_bytes=d.get("host_peak_bytes")))
    return out


def cross_check(case: str, spec: ParallelSpec, plan: Any = None) -> list[CrossCheckRow]:
    """Fake-mode prediction against the real gloo measurement, per rank."""
    from ..parallel.measure import measure_rank

    workload = CASES[case]()
    measured = measure_gloo(case, spec, plan=plan)
    rows = []
    for m in measured:
        p = measure_rank(workload, spec, plan, rank=m.rank)
        rows.append(CrossCheckRow(case, spec.world_size, m.rank, p.peak_bytes, m.peak_bytes, p.peak_split, m.peak_split,
                                  m.backend_staging_bytes, m.peak_without_staging_bytes,
                                  p.host_peak_bytes, m.host_peak_bytes))
    return rows


def markdown_table(rows: list[CrossCheckRow]) -> str:
    host = any(r.predicted_host_bytes is not None for r in rows)
    extra_head, extra_rule = (" predicted host peak | measured host peak |", "---:|---:|") if host else ("", "")
    lines = ["| model | world size | rank | predicted (fake) | measured (gloo) | gloo staging copies (sum over the step) | "
             f"measured without them | difference |{extra_head}",
             f"|---|---:|---:|---:|---:|---:|---:|---:|{extra_rule}"]
    for r in rows:
        extra = f" {r.predicted_host_bytes or 0:,} | {r.measured_host_bytes or 0:,} |" if host else ""
        lines.append(f"| {r.case} | {r.world_size} | {r.rank} | {r.predicted_bytes:,} | {r.measured_bytes:,} | "
                     f"{r.staging_bytes:,} | {r.comparable_bytes:,} | {r.difference_bytes:+,} |{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["tiny-gpt", "gpt", "mlp"], choices=sorted(CASES))
    ap.add_argument("--world-size", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--ddp", action="store_true", help="classic DistributedDataParallel instead of FSDP2")
    ap.add_argument("--gradient-as-bucket-view", action="store_true", help="with --ddp: gradients as views of its buckets")
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2 with CPUOffloadPolicy (host and device totals)")
    args = ap.parse_args(argv)
    rows = []
    for case in args.case:
        for ws in args.world_size:
            spec = ParallelSpec(world_size=ws, strategy="ddp" if args.ddp else "fsdp",
                                gradient_as_bucket_view=args.gradient_as_bucket_view, cpu_offload=args.cpu_offload)
            rows.extend(cross_check(case, spec))
    print(markdown_table(rows))
    return 0 if all(r.difference_bytes == 0 and r.measured_host_bytes == r.predicted_host_bytes for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
