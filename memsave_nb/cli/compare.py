"""``report --compare full,lora,qlora [--compare-precisions P,P] [--compare-seq-lens T,T]``: one
table across setups of one Hugging Face model (each row one fake-mode step measured), with the
target's verdict and max batch per row when ``--target-gb`` / ``--max-batch`` ask."""

from __future__ import annotations

import argparse
import copy
import sys

from ..errors import MemsaveError

SETUPS = ("full", "lora", "qlora")
DEFAULT_LORA = "r=16"
DEFAULT_QUANT = "nf4"
MAX_ROWS = 36  # each row is a measured step (and a search with --max-batch)


def _csv_setups(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values or any(v not in SETUPS for v in values):
        raise argparse.ArgumentTypeError(f"setups are {', '.join(SETUPS)} separated by commas; got {text[:40]!r}")
    return tuple(dict.fromkeys(values))


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    from .args import _csv_ints, _csv_precisions

    p.add_argument(
        "--compare",
        type=_csv_setups,
        default=None,
        metavar="SETUPS",
        help="Hugging Face models: one table across full, lora, qlora (LoRA: --lora or r=16; QLoRA: "
        "--quantize or nf4), x --compare-precisions x --compare-seq-lens",
    )
    p.add_argument(
        "--compare-precisions",
        type=_csv_precisions,
        default=None,
        metavar="P,P",
        help="with --compare: the precisions to compare (default: the model's)",
    )
    p.add_argument(
        "--compare-seq-lens",
        type=_csv_ints,
        default=None,
        metavar="T,T",
        help="with --compare: the sequence lengths to compare (default: --seq-len or the model's)",
    )


def check_compare_args(args: argparse.Namespace) -> None:
    from .parallel import wants_parallel
    from .workload import is_demo

    if args.compare is None:
        if args.compare_precisions or args.compare_seq_lens:
            raise MemsaveError("--compare-precisions and --compare-seq-lens need --compare SETUPS")
        return
    if is_demo(args.model):
        raise MemsaveError(
            f"--compare compares LoRA / QLoRA setups of a Hugging Face model; {args.model!r} is a demo model"
        )
    clash = [
        f
        for f, v in (
            ("--from-config", args.from_config),
            ("--out", args.out),
            ("--max-seq", args.max_seq),
            ("--precision", args.precision),
            ("--world-size", wants_parallel(args)),
        )
        if v
    ]
    if args.compare_seq_lens and args.seq_len is not None:
        clash.append("--seq-len")
    if clash:
        raise MemsaveError(f"--compare makes its own table; drop {', '.join(clash)}")
    rows = len(args.compare) * len(args.compare_precisions or (None,)) * len(args.compare_seq_lens or (None,))
    if rows > MAX_ROWS:
        raise MemsaveError(f"--compare asks for {rows} setups; at most {MAX_ROWS} (each is a measured step)")


def _variant(args: argparse.Namespace, setup: str, seq_len: int | None) -> argparse.Namespace:
    a = copy.copy(args)
    a.lora = None if setup == "full" else (args.lora or DEFAULT_LORA)
    a.quantize = (args.quantize or DEFAULT_QUANT) if setup == "qlora" else None
    a.seq_len = seq_len if seq_len is not None else args.seq_len
    a.one_shot = False
    return a


def compare_rows(args: argparse.Namespace, base) -> list[dict]:
    """Each setup x precision x sequence length measured with the knob flags' Plan ``base``: a dict
    per row (``--json`` prints them)."""
    from ..measure import measure
    from ..target import max_batch
    from .json_out import verdict_of
    from .target import _same_probe, cli_target
    from .workload import build

    target = cli_target(args) if args.target_gb is not None else None
    rows = []
    for setup in args.compare:
        for seq in args.compare_seq_lens or (None,):
            cw = build(_variant(args, setup, seq))
            for precision in args.compare_precisions or (None,):
                plan = base.replace(precision=precision)
                with plan.apply(cw.workload) as applied:
                    m = measure(applied, mode="fake", repeats=1)
                row = {
                    "setup": setup,
                    "lora": _variant(args, setup, seq).lora,
                    "quantize": _variant(args, setup, seq).quantize,
                    "precision": precision or "model's",
                    "seq_len": cw.workload.batch.seq_len,
                    "batch": cw.batch,
                    "peak_bytes": m.peak_bytes,
                    "peak_phase": m.peak_phase,
                    "split": dict(m.peak_split.as_dict()),
                    "fits": None,
                    "verdict": None,
                    "max_batch": None,
                }
                if target is not None:
                    v = verdict_of(target, m)
                    row["fits"], row["verdict"] = v["fits"], v["verdict"]
                    if args.max_batch:
                        row["max_batch"] = max_batch(
                            cw.workload, plan, target, measured=_same_probe(cw.workload, plan, m)
                        ).value
                rows.append(row)
    return rows


def compare_table(rows: list[dict]) -> str:
    from ..ui.format import render_table
    from ..units import format_bytes

    headers = ["setup", "precision", "seq", "batch", "peak", "parameters", "activations"]
    with_target = rows and rows[0]["verdict"] is not None
    with_max = rows and rows[0]["max_batch"] is not None
    headers += ["verdict"] * bool(with_target) + ["max batch"] * bool(with_max)
    body = []
    for r in rows:
        name = r["setup"] + (f" {r['quantize']}" if r["quantize"] else "") + (f" {r['lora']}" if r["lora"] else "")
        cells = [
            name,
            r["precision"],
            str(r["seq_len"]),
            str(r["batch"]),
            format_bytes(r["peak_bytes"]),
            format_bytes(r["split"].get("parameters", 0)),
            format_bytes(r["split"].get("activations", 0)),
        ]
        cells += [r["verdict"]] * bool(with_target) + [str(r["max_batch"])] * bool(with_max)
        body.append(cells)
    return render_table(headers, body, right={2, 3, 4, 5, 6} | ({8} if with_max else set()))


def run_compare(args: argparse.Namespace, base) -> int:
    """Print the comparison: one table (or one JSON object with ``--json``)."""
    rows = compare_rows(args, base)
    if args.json:
        from .json_out import dump

        dump({"schema": "memsave_nb.compare/1", "model": args.model, "rows": rows})
        return 0
    head = f"memsave_nb compare: {args.model}, fake mode, each row one measured step"
    if args.target_gb is not None:
        from .target import cli_target

        head += f"; {cli_target(args).line()}"
    sys.stdout.write(head + "\n\n" + compare_table(rows) + "\n")
    return 0
