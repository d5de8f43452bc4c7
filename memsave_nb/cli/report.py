"""``memsave-nb report``: measure a demo workload, print the per-layer table and the peak's
split, the knobs and the target; ``--out`` writes the HTML report."""

from __future__ import annotations

import argparse
import sys

from ..errors import MemsaveError
from .args import _positive_int


def _add_tuner_arguments(rep: argparse.ArgumentParser) -> None:
    """Workload knobs and the target GPU (memsave_nb.knobs, memsave_nb.target)."""
    from ..knobs import OPTIMIZERS, PRECISIONS
    from ..target import PRESETS_GB
    from ..workload import DEFAULT_LOOP, LOOPS

    rep.add_argument("--seq-len", type=_positive_int, default=None, metavar="T", help="cut or extend token inputs to T")
    rep.add_argument("--precision", choices=sorted(PRECISIONS), default=None, help="precision knob (default: the model's)")
    rep.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None, help="optimizer knob (default: AdamW)")
    rep.add_argument("--accumulate", type=_positive_int, default=None, metavar="K", help="K micro-batches per optimizer step")
    rep.add_argument("--keep-grads", action="store_true", help="zero_grad(set_to_none=False): gradients stay allocated")
    rep.add_argument("--loop", choices=list(LOOPS), default=DEFAULT_LOOP,
                     help="how long the model's output lives: loss_only (dropped before backward, as Hugging Face's "
                          "Trainer and the exported code), keep_output_backward, keep_output_step (default: loss_only)")
    rep.add_argument("--target-gb", type=float, default=None, metavar="GB",
                     help=f"the GPU's memory in GB (presets {', '.join(f'{g:g}' for g in PRESETS_GB)}): says fits / does not fit")
    rep.add_argument("--headroom", type=float, default=None, metavar="FRACTION",
                     help="usable share of the target (default 0.8: the 80%% rule)")
    rep.add_argument("--max-batch", action="store_true", help="with --target-gb: the largest batch that fits (bisection, fake mode)")
    rep.add_argument("--max-seq", action="store_true", help="with --target-gb: the longest sequence that fits (bisection, fake mode)")


def _knob_plan(args: argparse.Namespace):
    from ..plan import Plan

    return Plan(
        seq_len=args.seq_len,
        precision=args.precision,
        optimizer=args.optimizer,
        accumulation_steps=args.accumulate,
        set_to_none=False if args.keep_grads else None,
    )


def format_report(measurement, *, title: str, top: int | None = None) -> str:
    """The text the ``report`` command prints: heading, per-layer table, peak split, totals."""
    from ..ui.format import format_bytes, format_flops, format_seconds, layer_table, render_table, split_table

    m = measurement
    headers, rows = layer_table(m, top=top)
    layers = render_table(headers, rows, right={3, 4, 5})
    caption = f"(the {len(rows)} modules whose own ops save the most)" if top is not None else ""
    split_headers, split_rows = split_table(m)
    split_rows.append(["total", format_bytes(m.peak_bytes), "100.0%"])
    lines = [
        title,
        "",
        "Saved activations per layer " + caption if caption else "Saved activations per layer",
        layers,
        "",
        f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}" + _step_note(m, format_bytes),
        render_table(split_headers, split_rows, right={1, 2}),
        "",
        f"Saved activations: {format_bytes(m.saved_bytes)}   Outputs kept: {format_bytes(m.output_bytes)}   "
        f"FLOPs: {format_flops(m.flops)}   Step time: {format_seconds(m.step_seconds)}",
    ]
    if m.cuda_peak_bytes is not None:
        lines.append(f"CUDA allocator peak: {format_bytes(m.cuda_peak_bytes)} (tracker: {format_bytes(m.peak_bytes)})")
    lines.extend(f"Advice: {a}" for a in m.advice)
    lines.extend(f"Note: {n}" for n in m.notes)
    return "\n".join(lines) + "\n"


def _step_note(m, format_bytes) -> str:
    """Which training step the peak is, and the first step's peak beside a steady-state one."""
    if not m.steady_state:
        return " (first training step)"
    if m.first_step_peak_bytes is None:
        return " (steady state: training's step 2 on)"
    return f" (steady state: training's step 2 on; first step {format_bytes(m.first_step_peak_bytes)})"


def _report(args: argparse.Namespace) -> int:
    from .. import zoo
    from ..measure import measure
    from ..workload import check_device

    check_device(args.device)
    from .parallel import report_parallel, wants_parallel

    if wants_parallel(args):
        return report_parallel(args)
    mode = args.mode or ("fake" if args.model == "gpt-7b" else "real")
    if args.model == "gpt-7b" and mode == "real":
        raise MemsaveError("gpt-7b is built from fake tensors and only runs with --mode fake")
    workload = zoo.make(args.model, args.batch, device=args.device).replace(loop=args.loop)
    batch = args.batch or zoo.DEFAULT_BATCH.get(args.model)
    plan = _knob_plan(args)
    with plan.apply(workload) as applied:
        measurement = measure(applied, mode=mode, repeats=args.repeats)
    knobs = f", {plan.describe()}" if not plan.is_empty else ""
    title = f"memsave_nb report: {args.model}, batch {batch}{knobs}, {mode} mode on {measurement.device}, loop {args.loop}"
    sys.stdout.write(format_report(measurement, title=title, top=args.top))
    if args.target_gb is not None or args.max_batch or args.max_seq:
        from .target import cli_target_lines

        sys.stdout.write(cli_target_lines(workload, plan, measurement, args))
    if args.out:
        from ..report import write_report

        path = write_report(measurement, args.out, title=title, top=args.top)
        sys.stdout.write(f"\nWrote {path}\n")
    return 0
