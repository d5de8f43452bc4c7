"""``memsave-nb``: the command line.

    memsave-nb report [--model NAME] [--lora R] [--quantize nf4|int8] [--batch N] [--seq-len T]
                      [--mode real|fake] [--device cpu|cuda] [--top N] [--out FILE.html]
                      [knobs] [--target-gb GB [--max-batch] [--max-seq]] [--from-config PATH]
    memsave-nb report --world-size N [--fsdp | --ddp] [--model NAME] [knobs] [--target-gb GB]
    memsave-nb plan --target-gb GB [--model NAME] [--gpu H100] [--precisions P,P] [--gpus N [--tp T,T] [--pp P,P]]
                    [--micro-batches K,K] [--last-blocks N,N] [--checkpoint KIND] [knobs] [--save PLAN.json]
                    [--export hf|trl|axolotl|accelerate]

measures one training step of a demo workload (``memsave_nb.zoo``) or of any Hugging Face model
``memsave_nb.hub`` knows by name (fake mode), prints the answer first (peak, split, verdict, max
batch), then the per-layer table, and with ``--out`` writes the standalone HTML report. A user
mistake (unknown model, missing device, a bad or hostile number, flags that cannot apply) is one
line on stderr and exit code 2, found before anything is built or measured.

The front door: one module per subcommand (``report.py``, ``plan.py``; ``parallel.py`` and
``target.py`` for the report's per-rank and target sections; ``gloo.py`` the real cross-check).
The rooms below never see an ``argparse`` namespace.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import MemsaveError
from .args import _Parser, _positive_int, _UsageError
from .report import _add_tuner_arguments, _report, add_model_arguments, format_report  # noqa: F401 - format_report: public here too

PROG = "memsave-nb"
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="See what a PyTorch training step keeps in memory.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    rep = sub.add_parser(
        "report",
        help="measure a workload; print the answer, then the per-layer table; write an HTML report",
        description="Measure one training step of a demo workload or a Hugging Face model (by name, "
        "fake mode) and report its memory: the peak, its split and the verdict first.",
    )
    add_model_arguments(rep, "cnn")
    rep.add_argument(
        "--batch", type=_positive_int, default=None, metavar="N", help="batch size (default: the model's own)"
    )
    rep.add_argument(
        "--mode",
        choices=("real", "fake"),
        default=None,
        help="real: run the step; fake: shapes and bytes only (default: real; fake for gpt-7b and Hugging Face models)",
    )
    rep.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu or cuda (default: cpu)")
    rep.add_argument(
        "--top",
        type=_positive_int,
        default=None,
        metavar="N",
        help="show the N modules whose own ops save the most instead of every module",
    )
    rep.add_argument("--out", default=None, metavar="FILE.html", help="also write a standalone HTML report here")
    rep.add_argument("--repeats", type=_positive_int, default=3, metavar="N", help=argparse.SUPPRESS)
    _add_tuner_arguments(rep)
    from .parallel import add_arguments

    add_arguments(rep, _positive_int)
    from .plan import add_parser as add_plan_parser

    add_plan_parser(sub, _positive_int)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``memsave-nb``; returns the exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.one_shot = argv is None  # the console script's own process (not a caller's): see workload.build
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if args.command == "plan":
            from .plan import run_plan

            return run_plan(args)
        return _report(args)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MemsaveError as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # --out not writable, and the like
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
