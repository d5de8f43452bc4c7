"""The real cross-check's front door: built-in cases by name on a real gloo group, one process per rank.

The rank processes live in ``parallel/cross_check.py`` (``memsave_nb.parallel.cross_check`` takes
your own workload factory); this module names the built-in cases and prints the table.

``python -m memsave_nb.cli.gloo --case tiny-gpt --world-size 2 4 [--ddp | --cpu-offload]`` prints the table.
Classic DDP runs here exactly as in a training script (its default all-reduce, ``init_sync``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ..parallel.cross_check import CrossCheckRow, markdown_table  # noqa: F401 - the names callers import from here
from ..parallel.cross_check import cross_check as _cross_check
from ..parallel.cross_check import measure_gloo as _measure_gloo
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


def _factory(case: str | Callable[[], Any]) -> Callable[[], Any]:
    """A built-in case name, or the user's own workload factory as it is."""
    if callable(case):
        return case
    if case not in CASES:
        from ..errors import MemsaveError

        raise MemsaveError(f"unknown case {case!r}; choose from {', '.join(CASES)} or pass a workload factory")
    return CASES[case]


def measure_gloo(
    case: str | Callable[[], Any],
    spec: ParallelSpec,
    start_method: str = "fork",
    timeout_s: float = 600.0,
    plan: Any = None,
) -> list[RankMeasurement]:
    """Each rank's measured step on a real gloo group (``parallel.cross_check.measure_gloo``)."""
    return _measure_gloo(_factory(case), spec, plan=plan, start_method=start_method, timeout_s=timeout_s)


def cross_check(case: str | Callable[[], Any], spec: ParallelSpec, plan: Any = None) -> list[CrossCheckRow]:
    """Fake-mode prediction against the real gloo measurement, per rank (a case name or a factory)."""
    return _cross_check(_factory(case), spec, plan, name=case if isinstance(case, str) else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["tiny-gpt", "gpt", "mlp"], choices=sorted(CASES))
    ap.add_argument("--world-size", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--ddp", action="store_true", help="classic DistributedDataParallel instead of FSDP2")
    ap.add_argument(
        "--gradient-as-bucket-view", action="store_true", help="with --ddp: gradients as views of its buckets"
    )
    ap.add_argument("--cpu-offload", action="store_true", help="FSDP2 with CPUOffloadPolicy (host and device totals)")
    args = ap.parse_args(argv)
    rows = []
    for case in args.case:
        for ws in args.world_size:
            spec = ParallelSpec(
                world_size=ws,
                strategy="ddp" if args.ddp else "fsdp",
                gradient_as_bucket_view=args.gradient_as_bucket_view,
                cpu_offload=args.cpu_offload,
            )
            rows.extend(cross_check(case, spec))
    print(markdown_table(rows))
    return 0 if all(r.difference_bytes == 0 and r.measured_host_bytes == r.predicted_host_bytes for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
