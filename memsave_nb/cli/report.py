"""``memsave-nb report``: measure a workload (a demo model or a Hugging Face model by name) and
print the answer first (the peak, its split, fits / does not fit the target, the max batch), then
the per-layer table; ``--out`` writes the HTML report. Every flag is checked before anything is
built or measured."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import MemsaveError
from .args import _accumulate, _fraction, _gb, _positive_int


def add_model_arguments(p: argparse.ArgumentParser, default: str) -> None:
    """--model (a demo name or any model memsave_nb.hub knows) and its LoRA / QLoRA / task flags."""
    from .. import zoo
    from ..hub import TASKS
    from ..hub.quant import QUANT_TYPES

    p.add_argument(
        "--model",
        default=default,
        metavar="NAME",
        help=f"a demo workload ({', '.join(zoo.NAMES)}), a catalogue name (qwen2.5-7b, llama-3.1-8b, ...), "
        f"a hub id (Qwen/Qwen2.5-7B) or a local folder / config.json (default: {default})",
    )
    p.add_argument(
        "--lora",
        default=None,
        metavar="SETTINGS",
        help="Hugging Face models: LoRA, e.g. r=16 or r=16,alpha=32,target_modules=q_proj+v_proj",
    )
    p.add_argument(
        "--quantize", choices=QUANT_TYPES, default=None, help="Hugging Face models: QLoRA base weights (needs --lora)"
    )
    p.add_argument(
        "--task", choices=tuple(TASKS), default=None, help="Hugging Face models: the head (default: the config's)"
    )
    from ..vocabulary import DEFAULT_LOOP, LOOPS

    p.add_argument(
        "--loop",
        choices=list(LOOPS),
        default=DEFAULT_LOOP,
        help="how long the model's output lives: loss_only (dropped before backward, as Hugging Face's "
        "Trainer and the exported code), keep_output_backward, keep_output_step (default: loss_only)",
    )


def add_knob_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's knob flags (``knob_plan`` turns them into a Plan): ``report`` and ``plan --gpus``."""
    from ..vocabulary import LOSSES, OPTIMIZERS, PRECISIONS

    p.add_argument(
        "--precision", choices=sorted(PRECISIONS), default=None, help="precision knob (default: the model's)"
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None, help="optimizer knob (default: AdamW)")
    p.add_argument(
        "--accumulate", type=_accumulate, default=None, metavar="K", help="K micro-batches per optimizer step"
    )
    p.add_argument("--keep-grads", action="store_true", help="zero_grad(set_to_none=False): gradients stay allocated")
    p.add_argument(
        "--loss",
        choices=tuple(LOSSES),
        default=None,
        help=loss_help(),
    )
    p.add_argument(
        "--loss-chunk",
        type=_positive_int,
        default=None,
        metavar="TOKENS",
        help="with --loss chunked: tokens per chunk (default 1024)",
    )


def loss_help() -> str:
    """--loss's help, one clause per loss of the vocabulary (a loss added there is listed here)."""
    from ..vocabulary import LOSSES

    words = "; ".join(f"{name}: {meaning.split(': ')[0]}" for name, meaning in LOSSES.items())
    return f"causal LMs, the loss (default: the model's own): {words}".replace("%", "%%")


def check_knob_args(args: argparse.Namespace) -> None:
    """Knob flags that cannot apply together, refused before anything is built."""
    if args.loss_chunk is not None and args.loss != "chunked":
        raise MemsaveError("--loss-chunk needs --loss chunked")


def _add_tuner_arguments(rep: argparse.ArgumentParser) -> None:
    """Workload knobs and the target GPU (memsave_nb.knobs, memsave_nb.target)."""
    from ..target import PRESETS_GB

    rep.add_argument("--seq-len", type=_positive_int, default=None, metavar="T", help="cut or extend token inputs to T")
    add_knob_arguments(rep)
    rep.add_argument(
        "--target-gb",
        type=_gb,
        default=None,
        metavar="GB",
        help=f"the GPU's memory in GB as its maker counts it, read as GiB (presets {', '.join(f'{g:g}' for g in PRESETS_GB)}): says fits / does not fit",
    )
    rep.add_argument(
        "--headroom",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="with --target-gb: usable share of the target (default 0.8: the 80%% rule)",
    )
    rep.add_argument(
        "--max-batch", action="store_true", help="with --target-gb: the largest batch that fits (bisection, fake mode)"
    )
    rep.add_argument(
        "--max-seq", action="store_true", help="with --target-gb: the longest sequence that fits (bisection, fake mode)"
    )
    rep.add_argument(
        "--from-config",
        default=None,
        metavar="PATH",
        help="size this trainer config on --model: TrainingArguments / SFTConfig JSON, axolotl or accelerate YAML",
    )
    rep.add_argument(
        "--checkpoint",
        choices=("full", "save_matmuls"),
        default=None,
        help="checkpoint every repeated block this way (full: keep only its input; save_matmuls: "
        "keep the matmuls' outputs, recompute the rest)",
    )
    rep.add_argument(
        "--offload",
        action="store_true",
        help="offload what every repeated block saves for backward to host memory (CPU) until backward; "
        "the report's 'Host memory' line says how much the host holds and moves",
    )
    rep.add_argument(
        "--teach",
        action="store_true",
        help="the teacher's view: the bytes-per-parameter rule of thumb (weights, gradients, optimizer "
        "state) beside the measured bytes, and the split at each phase's peak",
    )
    from .worst import add_worst_arguments

    add_worst_arguments(rep)
    from .compare import add_compare_arguments

    add_compare_arguments(rep)
    rep.add_argument(
        "--fit-gpus",
        action="store_true",
        help="which GPUs of the catalogue (H100, A100, L4, RTX 4090, ...) the step fits, and the max batch on each",
    )
    rep.add_argument(
        "--explain",
        action="store_true",
        help="explain the peak: what the step holds then, which layers saved the most, and (with "
        "--target-gb) which single knob frees the most",
    )
    rep.add_argument(
        "--json",
        action="store_true",
        help="print the answer as one JSON object (schema memsave_nb.report/1, docs/cli.md) instead of text",
    )


KNOB_FLAGS = (
    ("--seq-len", "seq_len"),
    ("--precision", "precision"),
    ("--optimizer", "optimizer"),
    ("--accumulate", "accumulate"),
    ("--keep-grads", "keep_grads"),
    ("--loss", "loss"),
    ("--loss-chunk", "loss_chunk"),
    ("--checkpoint", "checkpoint"),
    ("--offload", "offload"),
)


def check_report_args(args: argparse.Namespace) -> None:
    """Combinations that cannot apply, refused in one line before anything is built or measured."""
    from .parallel import check_parallel_args, wants_parallel
    from .workload import check_model_flags

    if (args.max_batch or args.max_seq) and args.target_gb is None:
        raise MemsaveError("--max-batch and --max-seq need --target-gb")
    if args.headroom is not None and args.target_gb is None and not getattr(args, "fit_gpus", False):
        raise MemsaveError("--headroom needs --target-gb")
    check_knob_args(args)
    check_model_flags(args)
    check_parallel_args(args)
    if getattr(args, "offload", False) and args.checkpoint is not None:
        raise MemsaveError("--offload and --checkpoint: one kind per block; choose one")
    if getattr(args, "offload", False) and wants_parallel(args):
        raise MemsaveError("--offload: the single-device report; per rank, FSDP2's --cpu-offload moves parameters")
    if args.out is not None and os.path.isdir(args.out):
        raise MemsaveError(f"--out {args.out}: is a folder; give a file name like report.html")
    if args.from_config is not None:
        knobs = [flag for flag, key in KNOB_FLAGS if getattr(args, key) and not (key == "seq_len" and _is_hub(args))]
        if knobs:
            why = (
                " (precision: the config's bf16/fp16 over the dtype in the model's config.json)"
                if "--precision" in knobs
                else ""
            )
            raise MemsaveError(f"--from-config sets the knobs; drop {', '.join(knobs)} (or edit the config){why}")
        strategy = [
            f
            for f, k in (
                ("--fsdp", "fsdp"),
                ("--ddp", "ddp"),
                ("--cpu-offload", "cpu_offload"),
                ("--gradient-as-bucket-view", "gradient_as_bucket_view"),
            )
            if getattr(args, k)
        ]
        if strategy:
            raise MemsaveError(
                f"--from-config sets the parallel strategy; drop {', '.join(strategy)} "
                "(--world-size N still sets the ranks)"
            )
        from ..trainers.safe_read import read_file

        # a missing, unreadable, hostile (FIFO, device, alias bomb) file fails here, not after a build
        args.trainer_config = read_file(args.from_config)


def _is_hub(args: argparse.Namespace) -> bool:
    from .workload import is_demo

    return not is_demo(args.model)


def knob_plan(args: argparse.Namespace, *, hub: bool = False):
    """The Plan of the knob flags (a hub model gets --seq-len at build time, not as a knob)."""
    from ..plan import Plan

    return Plan(
        seq_len=None if hub else args.seq_len,
        precision=args.precision,
        optimizer=args.optimizer,
        accumulation_steps=args.accumulate,
        set_to_none=False if args.keep_grads else None,
        loss=args.loss,
        loss_chunk=args.loss_chunk,
    )


_knob_plan = knob_plan  # the old private name


def _plan_and_parallel(args: argparse.Namespace, cw):
    """The knob plan, or the trainer config's plan (and its parallel spec) with --from-config."""
    if getattr(args, "trainer_config", None) is None:
        return _with_checkpoint(knob_plan(args, hub=cw.hub), args, cw.workload.model), None, ()
    from ..trainers import from_trainer

    imported = from_trainer(args.trainer_config, cw.workload.model, world_size=args.world_size)
    if not cw.hub and imported.plan.batch_size:  # a demo batch is resized for real: check it fits first
        from .workload import check_fits_this_machine

        check_fits_this_machine(cw.name, imported.plan.batch_size, cw.mode, args.device)
    return imported.plan, imported.parallel, imported.notes


def _with_checkpoint(plan, args: argparse.Namespace, model):
    """``report --checkpoint KIND``: every repeated block checkpointed that way (as ``plan --checkpoint``);
    ``--offload``: every repeated block offloaded."""
    kind = "offload" if getattr(args, "offload", False) else getattr(args, "checkpoint", None)
    if kind is None:
        return plan
    from ..planner.depth import blocks_of

    blocks = blocks_of(model).names
    flag = "--offload" if kind == "offload" else "--checkpoint"
    if not blocks:
        raise MemsaveError(f"{flag}: {type(model).__name__} has no repeated blocks to {flag.lstrip('-')}")
    return plan.replace(regions={name: kind for name in blocks})


def format_report(measurement, *, title: str, top: int | None = None, answer: tuple[str, ...] = (), teach=None) -> str:
    """The text the ``report`` command prints: heading, the answer (peak, split, and the target's
    ``answer`` lines), then the per-layer table and the totals; ``teach`` (a ``TeacherView``): the
    rule of thumb beside the measured bytes, after the split."""
    from ..ui.format import format_bytes, format_flops, format_time_spread, layer_table, render_table, split_table

    m = measurement
    headers, rows = layer_table(m, top=top)
    layers = render_table(headers, rows, right={3, 4, 5})
    caption = f"(the {len(rows)} modules whose own ops save the most)" if top is not None else ""
    split_headers, split_rows = split_table(m)
    split_rows.append(["total", format_bytes(m.peak_bytes), "100.0%"])
    lines = [
        title,
        "",
        peak_line(m),
        *host_lines(m),
        *answer,
        render_table(split_headers, split_rows, right={1, 2}),
        *_teach_block(teach),
        "",
        "Saved activations per layer " + caption if caption else "Saved activations per layer",
        layers,
        "",
        f"Saved activations: {format_bytes(m.saved_bytes)}   Outputs kept: {format_bytes(m.output_bytes)}   "
        f"FLOPs: {format_flops(m.flops)}   Step time: {format_time_spread(m)}{_noisy(m)}",
    ]
    if m.cuda_peak_bytes is not None:
        lines.append(f"CUDA allocator peak: {format_bytes(m.cuda_peak_bytes)} (tracker: {format_bytes(m.peak_bytes)})")
    lines.extend(f"Advice: {a}" for a in m.advice)
    lines.extend(f"Note: {n}" for n in m.notes)
    return "\n".join(lines) + "\n"


def host_lines(m, link: str = "pcie5") -> list[str]:
    """The 'Host memory' line, where the step offloads anything (``Measurement.host``)."""
    host = getattr(m, "host", None)
    if host is None or not (host.to_host_bytes or host.tensors):
        return []
    from ..offload import LINKS, transfer_seconds
    from ..ui.format import format_bytes, format_seconds

    return [
        f"Host memory: {format_bytes(host.peak_bytes)} at most (offloaded activations, {host.tensors} copies); "
        f"moved per step: {format_bytes(host.to_host_bytes)} to the host in forward, "
        f"{format_bytes(host.to_device_bytes)} back in backward "
        f"(~{format_seconds(transfer_seconds(host.to_host_bytes, link))} over {LINKS[link].name})"
    ]


def _teach_block(view) -> list[str]:
    if view is None:
        return []
    from ..ui.format import render_table
    from ..ui.teach_table import phase_table, rule_table, teach_lines

    rh, rr = rule_table(view)
    ph, pr = phase_table(view)
    return [
        "",
        "Rule of thumb vs measured (bytes per parameter; the measured bytes are the most the step held)",
        render_table(rh, rr, right={1, 2, 3, 4, 5, 6}),
        "",
        render_table(ph, pr, right={1, 2, 3, 4, 5, 6}),
        *teach_lines(view),
    ]


def teacher_view_of(applied, plan, measurement, optimizer=None):
    """The teacher's view of the step just measured (inside ``plan.apply``: the model as it ran).
    ``optimizer``: the workload's own before the plan (the plan's bf16_master wraps it)."""
    from ..measure.rule_of_thumb import teacher_view
    from ..vocabulary import OPTIMIZER_ALIASES

    name = plan.optimizer or optimizer
    name = OPTIMIZER_ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else None
    return teacher_view(measurement, applied.model, name, master=plan.precision == "bf16_master")


HUB_TOP = 20  # a Hugging Face model has a thousand modules: its table lists the top ones unless --top says
NOISY_RATIO = 1.5  # slowest over fastest timed step above this: the machine was busy


def _noisy(m) -> str:
    from ..ui.format import time_spread

    _, lo, hi, n = time_spread(m)
    if n >= 2 and lo and hi is not None and hi / lo > NOISY_RATIO:
        return " - noisy: the machine was busy, compare step times with care"
    return ""


def peak_line(m) -> str:
    """The answer's first line: the peak, its phase and which training step it is."""
    from ..ui.format import format_bytes

    return f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}" + _step_note(m, format_bytes)


def _step_note(m, format_bytes) -> str:
    """Which training step the peak is, and the first step's peak beside a steady-state one."""
    if not m.steady_state:
        return " (first training step)"
    if m.first_step_peak_bytes is None:
        return " (steady state: training's step 2 on)"
    return f" (steady state: training's step 2 on; first step {format_bytes(m.first_step_peak_bytes)})"


def _sized_for(workload, measurement) -> str:
    """The title's words for a step sized as another device runs it (``Workload.sized_for``): the
    optimizer step and the attention backend it ran (``measure.common.sized_words``)."""
    from ..measure.common import sized_words

    words = sized_words(measurement.notes)
    return words or (", sized as CUDA runs it (foreach optimizer step)" if workload.sized_for == "cuda" else "")


def _report(args: argparse.Namespace) -> int:
    from ..measure import measure
    from ..workload import check_device
    from .parallel import report_parallel, wants_parallel
    from .workload import build

    check_report_args(args)
    check_device(args.device)
    from .worst import resolve_worst

    lengths = resolve_worst(args)
    from .compare import check_compare_args, run_compare

    check_compare_args(args)
    if args.compare is not None:
        return run_compare(args, knob_plan(args, hub=True))
    cw = build(args, device=args.device)
    plan, spec, notes = _plan_and_parallel(args, cw)
    if wants_parallel(args) or spec is not None:
        single = [
            f for f, v in (("--json", args.json), ("--fit-gpus", args.fit_gpus), ("--explain", args.explain)) if v
        ]
        if single:
            raise MemsaveError(f"{', '.join(single)}: for the single-device report; the per-rank report prints text")
        return report_parallel(args, cw, plan, spec, notes)
    with plan.apply(cw.workload) as applied:
        measurement = measure(applied, mode=cw.mode, repeats=args.repeats)
        teach = teacher_view_of(applied, plan, measurement, cw.workload.optimizer)
    knobs = f", {plan.describe()}" if not plan.is_empty else ""
    from .setup_words import setup_words

    title = f"memsave_nb report: {cw.name}{setup_words(args, cw.workload, cw.hub)}, batch {plan.batch_size or cw.batch}{knobs}, {cw.mode} mode on {measurement.device}{_sized_for(cw.workload, measurement)}, loop {cw.workload.loop}"
    top = args.top if args.top is not None or not cw.hub else HUB_TOP
    if args.json:
        from .json_out import dump, report_json

        obj = report_json(args, cw, plan, measurement, title, top, notes, teach=teach)
        obj["setup"]["worst_sample"] = (
            None
            if lengths is None
            else {
                "seq_len": lengths.worst,
                "samples": lengths.samples,
                "median": lengths.quantile(0.5),
                "p99": lengths.quantile(0.99),
            }
        )
        if args.explain:
            from .explain import explain_lines
            from .target import cli_target

            obj["explain"] = explain_lines(
                cw.workload, plan, measurement, cli_target(args) if args.target_gb is not None else None
            )
        if args.fit_gpus:
            from .gpu_fit import gpu_fit_rows

            obj["gpus"] = gpu_fit_rows(cw.workload, plan, measurement, args.headroom)
        dump(obj)
        if args.out:
            from ..report import write_report

            write_report(
                measurement,
                args.out,
                title=title,
                top=args.top,
                answer=(peak_line(measurement), *host_lines(measurement)),
                teach=teach,
            )
        return 0
    answer: tuple[str, ...] = ()
    explained = ""
    if args.target_gb is not None:
        from .target import cli_target_lines

        answer, explained = cli_target_lines(cw.workload, plan, measurement, args)
    if lengths is not None:
        answer = (f"Sized at the {lengths.words()}", *answer)
    if args.explain:
        from .explain import explain_lines
        from .target import cli_target

        target = cli_target(args) if args.target_gb is not None else None
        answer = (*answer, *explain_lines(cw.workload, plan, measurement, target))
    if args.fit_gpus:
        from .gpu_fit import gpu_fit_lines, gpu_fit_rows

        answer = (*answer, *gpu_fit_lines(gpu_fit_rows(cw.workload, plan, measurement, args.headroom)))
    text = format_report(measurement, title=title, top=top, answer=answer, teach=teach if args.teach else None)
    sys.stdout.write(text + "".join(f"Note: {n}\n" for n in notes) + explained)
    if args.out:
        from ..report import write_report

        path = write_report(
            measurement,
            args.out,
            title=title,
            top=args.top,
            answer=(peak_line(measurement), *host_lines(measurement), *answer),
            teach=teach,
        )
        sys.stdout.write(f"\nWrote {path}\n")
    return 0
