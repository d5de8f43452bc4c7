"""``memsave-nb report --world-size N [--fsdp | --ddp]``: the per-rank table of a demo workload."""

from __future__ import annotations

import argparse
import sys

from ..errors import MemsaveError


def add_arguments(rep: argparse.ArgumentParser, positive_int) -> None:
    rep.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                     help="size each of N ranks in fake mode (FSDP2 by default) instead of one device")
    group = rep.add_mutually_exclusive_group()
    group.add_argument("--fsdp", action="store_true", help="with --world-size: FSDP2 fully_shard per repeated block plus the root")
    group.add_argument("--ddp", action="store_true", help="with --world-size: DistributedDataParallel")
    rep.add_argument("--gradient-as-bucket-view", action="store_true",
                     help="with --ddp: gradients are views of DDP's buckets (one gradient copy instead of two)")
    rep.add_argument("--cpu-offload", action="store_true",
                     help="with --world-size: FSDP2 CPUOffloadPolicy (sharded parameters, gradients, optimizer on the host)")


def wants_parallel(args: argparse.Namespace) -> bool:
    return args.world_size is not None or args.fsdp or args.ddp or args.gradient_as_bucket_view or args.cpu_offload


def report_parallel(args: argparse.Namespace) -> int:
    from .. import zoo
    from ..parallel.measure import measure_parallel
    from ..parallel_spec import ParallelSpec

    if args.world_size is None:
        raise MemsaveError("--fsdp, --ddp, --gradient-as-bucket-view and --cpu-offload need --world-size N")
    if args.out:
        raise MemsaveError("--out writes single-device reports; drop it with --world-size")
    if args.mode == "real":
        raise MemsaveError("--world-size sizes ranks in fake mode only; drop --mode real")
    if args.gradient_as_bucket_view and not args.ddp:
        raise MemsaveError("--gradient-as-bucket-view needs --ddp")
    if args.cpu_offload and args.ddp:
        raise MemsaveError("--cpu-offload is FSDP2's CPUOffloadPolicy; drop --ddp")
    spec = ParallelSpec(world_size=args.world_size, strategy="ddp" if args.ddp else "fsdp",
                        gradient_as_bucket_view=args.gradient_as_bucket_view, cpu_offload=args.cpu_offload)
    workload = zoo.make(args.model, args.batch, device=args.device).replace(loop=args.loop)
    batch = args.batch or zoo.DEFAULT_BATCH.get(args.model)
    m = measure_parallel(workload, spec)
    sys.stdout.write(f"memsave_nb per-rank report: {args.model}, batch {batch} per rank, fake mode, loop {args.loop}\n\n"
                     f"{m.table()}\n")
    return 0
