"""``memsave-nb plan``: the planner from the command line. Which setups of a workload (a demo model
or a Hugging Face model by name) fit a target GPU; the Pareto front as a table, lowest peak first;
the chosen plan (the fastest that fits) as code, as a plan file with ``--save`` and as a trainer's
config with ``--export``. Paths are checked before the search."""

from __future__ import annotations

import argparse
import sys

from ..errors import MemsaveError
from .args import PRECISIONS, _csv_ints, _csv_precisions  # kept importable here: their old home


def add_parser(sub, positive_int) -> None:
    from ..planner.roofline import GPUS
    from ..trainers import TRAINERS
    from .args import _fraction, _gb
    from .report import add_knob_arguments, add_model_arguments

    p = sub.add_parser(
        "plan",
        help="find the setups of a workload that fit a target GPU; the fastest that fits is chosen",
        description="Search freezing, checkpointing/offloading per block, precision and micro-batching "
        "for the plans that fit a target GPU; print the Pareto front (lowest peak first) and "
        "the chosen plan (the fastest that fits) as code.",
    )
    add_model_arguments(p, "gpt")
    p.add_argument(
        "--batch", type=positive_int, default=None, metavar="N", help="batch size (default: the model's own)"
    )
    p.add_argument(
        "--seq-len", type=positive_int, default=None, metavar="T", help="Hugging Face models: the sequence length"
    )
    p.add_argument(
        "--target-gb",
        type=_gb,
        required=True,
        metavar="GB",
        help="the GPU's memory in GB as its maker counts it (read as GiB: an 80 GB H100 is 80 GiB)",
    )
    p.add_argument(
        "--headroom",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="usable share of the target (default 0.8: the 80%% rule)",
    )
    p.add_argument(
        "--gpu",
        default="H100",
        choices=sorted(GPUS) + ["host"],
        help="whose FLOP/s and bandwidth estimate the step time (default: H100); with --gpus, the GPUs' kind "
        "(its links between GPUs too)",
    )
    p.add_argument(
        "--mode",
        choices=("real", "fake"),
        default=None,
        help="fake (default): shapes and bytes only; real: run the steps on this machine",
    )
    p.add_argument(
        "--precisions",
        type=_csv_precisions,
        default=None,
        metavar="P,P",
        help=f"precisions to try, from {', '.join(PRECISIONS)} (default: fp32; with --gpus the planner "
        "searches them; --precision P keeps one)",
    )
    p.add_argument(
        "--micro-batches",
        type=_csv_ints,
        default=(1,),
        metavar="K,K",
        help="gradient-accumulation splits to try, e.g. 1,2,4 (default: 1)",
    )
    p.add_argument(
        "--last-blocks",
        type=_csv_ints,
        default=(),
        metavar="N,N",
        help="also try training only the last N blocks (default: full fine-tuning only); with --gpus one N: "
        "the freezing every layout keeps",
    )
    p.add_argument(
        "--checkpoint",
        choices=("full", "save_matmuls"),
        default=None,
        help="the checkpointing kind: with --gpus every repeated block checkpointed this way on every "
        "layout; without, the only kind the search puts on blocks (default: searched)",
    )
    add_knob_arguments(p)
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        metavar="N",
        help="search how to spread the step over N GPUs of kind --gpu (DDP, FSDP2, HSDP, CPU offload, "
        "tensor parallel x FSDP2, pipeline stages x FSDP2); --target-gb is each GPU's memory",
    )
    p.add_argument(
        "--tp",
        type=_csv_ints,
        default=None,
        metavar="T,T",
        help="with --gpus: tensor-parallel degrees to try (default 1,2,4,8 where they divide N within a node)",
    )
    p.add_argument(
        "--pp",
        type=_csv_ints,
        default=None,
        metavar="P,P",
        help="with --gpus: pipeline stage counts to try where they split N and the blocks (default: 2,4,8 only when nothing without stages fits)",
    )
    p.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --gpus: sequences per optimizer step over all GPUs (default: the batch x N)",
    )
    p.add_argument("--save", default=None, metavar="PLAN.json", help="write the chosen plan here")
    p.add_argument(
        "--export",
        choices=sorted(TRAINERS),
        default=None,
        help="print the chosen plan as this trainer's config (hf: TrainingArguments, trl: SFTConfig, axolotl, accelerate)",
    )
    p.add_argument("--export-to", default=None, metavar="PATH", help="with --export: write that config here")
    from .worst import add_worst_arguments

    add_worst_arguments(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="print the answer as one JSON object (schema memsave_nb.plan/1, docs/cli.md) instead of text",
    )


def run_plan(args: argparse.Namespace) -> int:
    from .. import presets
    from ..plan import Plan
    from ..target import Target
    from ..units import format_bytes
    from ..planner.search import REGION_KINDS, plan_for
    from .args import check_writable
    from .report import check_knob_args, knob_plan
    from .workload import build, check_model_flags, is_demo

    check_model_flags(args)
    from .worst import resolve_worst

    resolve_worst(args)  # --worst-of / --seq-lens-from: the longest sample's length is --seq-len
    if args.seq_len is not None and is_demo(args.model):
        raise MemsaveError(
            f"plan --seq-len sets a Hugging Face model's sequence; {args.model!r} is a demo model "
            "(its batch keeps its own length)"
        )
    if args.export_to and not args.export:
        raise MemsaveError("--export-to needs --export hf|trl|axolotl|accelerate")
    for flag, path in (("--save", args.save), ("--export-to", args.export_to)):
        if path:
            check_writable(path, flag)
    check_knob_args(args)
    if args.precision is not None and args.precisions is not None:
        raise MemsaveError("give --precision P (kept) or --precisions P,P (searched), not both")
    target = Target(args.target_gb) if args.headroom is None else Target(args.target_gb, headroom=args.headroom)
    if args.gpus is not None and args.json:
        raise MemsaveError("--json is for the single-device planner; plan --gpus prints text")
    if args.gpus is not None:
        return _run_layout(args, target)
    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--global-batch", args.global_batch)):
        if value is not None:
            raise MemsaveError(f"{flag} needs --gpus N")
    if args.accumulate is not None:
        raise MemsaveError("plan searches the gradient accumulation: give --micro-batches K,K instead of --accumulate")
    if args.mode is None:
        args.mode = "fake"
    cw = build(args)
    workload = cw.workload
    freezing = {"all trainable": Plan()}
    for n in args.last_blocks:
        freezing[f"last {n} blocks"] = presets.last_blocks(workload.model, n)
    base = knob_plan(args, hub=True)  # the knobs every plan keeps (a hub model took --seq-len at build time)
    precisions = _precisions(args.precisions or (base.precision or "fp32",))
    result = plan_for(
        workload,
        target,
        mode=args.mode,
        device=args.gpu,
        freezing=freezing,
        precisions=precisions,
        micro_batches=args.micro_batches,
        base_plan=base.replace(precision=None),
        region_kinds=(args.checkpoint,) if args.checkpoint else REGION_KINDS,
    )
    if args.json:
        return _plan_json(args, result, workload, target)
    out = [result.summary(), "", "Pareto front (lowest peak first):"]
    rows = [("estimated peak", "estimated step", "fits", "plan")]
    for c in result.front:
        rows.append(
            (format_bytes(c.est_peak_bytes), f"{c.est_seconds * 1e3:.1f} ms", "yes" if c.fits else "no", c.label)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        out.append("  " + "  ".join(r[i].rjust(widths[i]) for i in range(3)) + "  " + r[3])
    if result.chosen is not None:
        out += _chosen_lines(args, result.chosen.plan, workload, "plan")
    else:
        from ..planner.what_fits import hint_lines, what_would_fit

        hints = what_would_fit(workload, Plan(), target, mode=args.mode)
        out += [
            "",
            "Nothing searched fits. Each knob on its own from the baseline (fake-mode probes):",
            *(f"  {line}" for line in hint_lines(hints, target)),
        ]
        out += [f"No plan fits: nothing written to {p}" for p in (args.save, args.export_to) if p]
    sys.stdout.write("\n".join(out) + "\n")
    return 0 if result.chosen is not None else 1


def _plan_json(args: argparse.Namespace, result, workload, target) -> int:
    """``plan --json``: one JSON object; --save / --export-to are written as without it."""
    from .json_out import dump, plan_json

    hints = None
    if result.chosen is None:
        from ..plan import Plan
        from ..planner.what_fits import what_would_fit

        hints = what_would_fit(workload, Plan(), target, mode=args.mode)
    obj = plan_json(args, result, hints)
    if result.chosen is not None:
        _chosen_lines(args, result.chosen.plan, workload, "plan")  # writes --save / --export-to
        if args.export:
            from ..trainers import to_trainer

            exported = to_trainer(result.chosen.plan, args.export, model=workload.model)
            obj["export"] = {"trainer": args.export, "text": exported.text, "notes": list(exported.notes)}
    dump(obj)
    return 0 if result.chosen is not None else 1


def _run_layout(args: argparse.Namespace, target) -> int:
    """``plan --gpus N``: the layout planner; the chosen layout and the front first, then the code."""
    from ..planner.layout import check_layout_args, plan_layout
    from .workload import build

    check_layout_args(args.gpus, args.gpu, args.tp)
    if args.mode == "real":
        raise MemsaveError("plan --gpus sizes ranks in fake mode only; drop --mode real")
    if args.micro_batches != (1,):
        raise MemsaveError("plan --gpus takes micro-batches from --global-batch; drop --micro-batches")
    if len(args.last_blocks) > 1:
        raise MemsaveError(
            "plan --gpus starts from one plan: give one --last-blocks N (plan without --gpus compares several)"
        )
    if args.accumulate is not None and args.global_batch is not None:
        raise MemsaveError("--global-batch sets the sequences per optimizer step; drop --accumulate")
    args.mode = "fake"
    workload = build(args).workload
    result = plan_layout(
        workload,
        args.gpus,
        args.gpu,
        target,
        global_batch=args.global_batch,
        tensor_parallel=args.tp,
        pipeline_parallel=args.pp,
        precisions=_precisions(args.precisions or ("fp32",)),
        plan=_start_plan(args, workload),
    )
    out = [result.summary(), "", "Pareto front of the layouts that fit (lowest peak first):", result.front_table()]
    if result.remeasured is not None:
        out += ["", "The chosen layout measured per rank:", result.remeasured.table()]
    if result.chosen is not None:
        out += _chosen_lines(args, result.chosen.plan, workload, "layout")
    else:
        out += [f"No layout fits: nothing written to {p}" for p in (args.save, args.export_to) if p]
    sys.stdout.write("\n".join(out) + "\n")
    return 0 if result.chosen is not None else 1


def _precisions(names) -> tuple[str | None, ...]:
    return tuple(None if p == "fp32" else p for p in names)


def _start_plan(args: argparse.Namespace, workload):
    """The plan ``plan --gpus`` starts from: the knob flags (``report.knob_plan``), one ``--last-blocks``
    freezing, ``--checkpoint`` on every block, and with ``--accumulate K`` the batch per GPU (the
    built batch x K); None when empty."""
    from .. import presets
    from ..knobs import batch_size_of
    from ..target import _raw_batch
    from .report import knob_plan

    plan = knob_plan(args, hub=True)  # a hub model took --seq-len at build time; a demo model refused it
    if args.last_blocks:
        freezing = presets.last_blocks(workload.model, args.last_blocks[0])
        plan = plan.replace(frozen=freezing.frozen, trainable=freezing.trainable)
    if args.accumulate is not None:
        plan = plan.replace(batch_size=batch_size_of(_raw_batch(workload)))
    if args.checkpoint is not None:
        from ..planner.depth import blocks_of

        blocks = blocks_of(workload.model).names
        if not blocks:
            raise MemsaveError(f"--checkpoint: {type(workload.model).__name__} has no repeated blocks to checkpoint")
        plan = plan.replace(regions={name: args.checkpoint for name in blocks})
    return None if plan.is_empty else plan


def _chosen_lines(args: argparse.Namespace, plan, workload, what: str) -> list[str]:
    """The chosen plan (or layout) as code, and written where --save / --export ask."""
    code = plan.to_code(loop=workload.loop)  # a pipeline layout too: its stages, schedule and step
    out = ["", f"The chosen {what} as code:", "", code]
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            f.write(plan.to_json(indent=2))
        out.append(f"Wrote {args.save}")
    if args.export:
        out += _export(plan, args.export, workload.model, args.export_to)
    return out


def _export(plan, trainer: str, model, path: str | None) -> list[str]:
    """The chosen plan as ``trainer``'s config (memsave_nb.to_trainer), and what it cannot say."""
    from ..trainers import to_trainer

    exported = to_trainer(plan, trainer, model=model)
    out = ["", f"The chosen plan as a {trainer} config:", "", exported.text.rstrip()]
    out += [f"  note: {n}" for n in exported.notes]
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(exported.text)
        out.append(f"Wrote {path}")
    return out
