"""``memsave-nb report --world-size N [--fsdp | --ddp] [--tp T [--sequence-parallel]] [--replicate R]``: the per-rank answer and table of a workload,
with the same knob plan (and target) as the single-device report."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from ..errors import MemsaveError


def add_arguments(rep: argparse.ArgumentParser, positive_int) -> None:
    rep.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="size each of N ranks in fake mode (FSDP2 by default) instead of one device",
    )
    group = rep.add_mutually_exclusive_group()
    group.add_argument(
        "--fsdp", action="store_true", help="with --world-size: FSDP2 fully_shard per repeated block plus the root"
    )
    group.add_argument("--ddp", action="store_true", help="with --world-size: DistributedDataParallel")
    rep.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="with --ddp: gradients are views of DDP's buckets (one gradient copy instead of two)",
    )
    rep.add_argument(
        "--reshard-root",
        action="store_true",
        help="with --world-size: the FSDP2 root resharded after forward too, as accelerate's FSDP2 plugin "
        "does (torch's default keeps the root's parameters gathered until backward)",
    )
    rep.add_argument(
        "--cpu-offload",
        action="store_true",
        help="with --world-size: FSDP2 CPUOffloadPolicy (sharded parameters, gradients, optimizer on the host)",
    )
    rep.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="T",
        help="with --world-size: tensor parallel of degree T inside FSDP2 (mesh (N/T, T); the default "
        "decoder plan: attention q/k/v and MLP up/gate column-wise, o and down row-wise)",
    )
    rep.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and the residual stream sharded over the sequence (torchtitan's layouts)",
    )
    rep.add_argument(
        "--replicate",
        type=positive_int,
        default=None,
        metavar="R",
        help="with --world-size: HSDP, R replica groups of N/R sharded ranks",
    )
    rep.add_argument(
        "--pp",
        type=positive_int,
        default=None,
        metavar="P",
        help="with --world-size: P pipeline stages under torch.distributed.pipelining (nn.Sequential "
        "and GPT-shaped models, split evenly), FSDP2 over the other N/P ranks; one row per stage",
    )
    rep.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved_1f1b"),
        default=None,
        help="with --pp: the pipeline schedule (default 1f1b; interleaved: two stages per rank)",
    )
    rep.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        metavar="M",
        help="with --pp: micro-batches per step (default 4; must divide the batch)",
    )


def wants_parallel(args: argparse.Namespace) -> bool:
    return (
        args.world_size is not None
        or args.fsdp
        or args.ddp
        or args.gradient_as_bucket_view
        or args.cpu_offload
        or args.reshard_root
        or args.tp is not None
        or args.sequence_parallel
        or args.replicate is not None
        or args.pp is not None
        or args.schedule is not None
        or args.microbatches is not None
    )


# single-device flags the per-rank report does not take
_SINGLE_ONLY = (("--out", "out"), ("--top", "top"), ("--max-batch", "max_batch"), ("--max-seq", "max_seq"))


def check_parallel_args(args: argparse.Namespace) -> None:
    """Per-rank flag combinations that cannot apply, refused before anything is built."""
    if not wants_parallel(args):
        return
    if args.world_size is None:
        raise MemsaveError(
            "--fsdp, --ddp, --gradient-as-bucket-view, --cpu-offload, --reshard-root, --tp, "
            "--sequence-parallel, --replicate, --pp, --schedule and --microbatches need --world-size N"
        )
    for flag, key in _SINGLE_ONLY:
        if getattr(args, key):
            raise MemsaveError(f"{flag} applies to single-device reports; drop it with --world-size")
    if args.mode == "real":
        raise MemsaveError("--world-size sizes ranks in fake mode only; drop --mode real")
    if args.gradient_as_bucket_view and not args.ddp:
        raise MemsaveError("--gradient-as-bucket-view needs --ddp")
    if args.reshard_root and args.ddp:
        raise MemsaveError("--reshard-root is FSDP2's; drop --ddp")
    if args.cpu_offload and args.ddp:
        raise MemsaveError("--cpu-offload is FSDP2's CPUOffloadPolicy; drop --ddp")
    if args.sequence_parallel and not (args.tp or 1) > 1:
        raise MemsaveError("--sequence-parallel needs --tp 2 or more")
    if args.ddp and ((args.tp or 1) > 1 or (args.replicate or 1) > 1):
        raise MemsaveError("--tp and --replicate combine with FSDP2; drop --ddp")
    if (args.schedule is not None or args.microbatches is not None) and args.pp is None:
        raise MemsaveError("--schedule and --microbatches need --pp P")
    if args.pp is not None and (args.ddp or args.cpu_offload):
        raise MemsaveError(
            "--pp is measured alone or with FSDP2, HSDP (--replicate) or TP (--tp): drop --ddp and --cpu-offload"
        )


def parallel_spec(args: argparse.Namespace):
    from ..parallel_spec import ParallelSpec

    pipeline: dict[str, Any] = (
        dict(schedule=args.schedule or "1f1b", microbatches=args.microbatches or 4) if args.pp else {}
    )
    return ParallelSpec(
        world_size=args.world_size,
        strategy="ddp" if args.ddp else "fsdp",
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        cpu_offload=args.cpu_offload,
        reshard_root=args.reshard_root,
        tensor_parallel=args.tp or 1,
        sequence_parallel=args.sequence_parallel,
        replicate=args.replicate or 1,
        pipeline_parallel=args.pp or 1,
        **pipeline,  # else the spec's own defaults
    )


def _cross_entropy(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output, target)


def report_parallel(args: argparse.Namespace, cw, plan, spec=None, notes=()) -> int:
    """Measure every distinct rank under ``plan`` (the knob flags, or a trainer config's plan) and
    print the answer (worst rank's peak, verdict, split), then the per-rank table."""
    from ..parallel.measure import measure_parallel
    from ..units import format_bytes

    if spec is None:  # a trainer config's spec (its strategy, --world-size's ranks) wins
        spec = parallel_spec(args)
    with (
        warnings.catch_warnings()
    ):  # FSDP2's advice on in-place ops on a view output: about the user's loop, not this sizing
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if spec.pipeline_parallel > 1:
            import torch

            from ..parallel.pipeline import measure_pipeline

            targets = getattr(cw.workload.loss, "targets", None)  # the zoo MLP's labels: cross-entropy per micro-batch
            per_micro: dict[str, Any] = (
                dict(loss_fn=_cross_entropy, target=targets) if isinstance(targets, torch.Tensor) else {}
            )
            m = measure_pipeline(cw.workload, spec, plan, **per_micro)
        else:
            m = measure_parallel(cw.workload, spec, plan)
    worst = m.worst
    knobs = f", {plan.describe()}" if not plan.is_empty else ""
    lines = [
        f"memsave_nb per-rank report: {cw.name}, {spec.describe()}, batch {plan.batch_size or cw.batch} per rank{knobs}, "
        f"fake mode, loop {cw.workload.loop}",
        "",
        f"Peak per rank: {format_bytes(m.device_peak_bytes)} (worst rank {worst.rank}, during "
        f"{worst.device_peak_phase or worst.peak_phase}); with the unseen lines "
        f"{format_bytes(m.device_peak_bytes + m.unseen_low_bytes)} .. {format_bytes(m.device_peak_bytes + m.unseen_high_bytes)}",
    ]
    explained = ""
    if args.target_gb is not None:
        from ..target import Target
        from .target import cli_target, verdict_line

        from ..parallel.verdict import worst_fit

        target = cli_target(args)
        rank, fit = worst_fit(target, m)
        if fit.replay is not None:  # every rank replayed through the allocator model: its verdict, no 80% rule
            lines.append(f"Target {target.label} per rank: {fit.verdict(target)}; deciding rank {rank.rank}")
            lines += list(fit.replay.lines()[1:])
        else:  # no replay (none is made for these ranks): the 80% rule, and the unseen lines on the whole GPU
            lines.append(verdict_line(target, m.device_peak_bytes, " per rank") + " (80% rule, no allocator replay)")
            whole = Target(target.gb, 1.0, target.name)  # the unseen lines are what the headroom is for
            lines.append(
                f"  with the unseen lines' upper end ({format_bytes(m.device_peak_bytes + m.unseen_high_bytes)}) on "
                f"the whole GPU: {whole.verdict(m.device_peak_bytes + m.unseen_high_bytes)}"
            )
            explained = "\n" + target.line() + "\n"
    split = worst.device_peak_split or worst.peak_split
    lines.append("Split: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in split.items() if v))
    lines += ["", m.table()]
    lines += [f"Note: {n}" for n in notes]
    sys.stdout.write("\n".join(lines) + "\n" + explained)
    return 0
