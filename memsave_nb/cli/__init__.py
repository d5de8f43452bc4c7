"""``memsave-nb``: the command line.

    memsave-nb report [--model NAME] [--batch N] [--mode real|fake] [--device cpu|cuda]
                      [--top N] [--out FILE.html]
    memsave-nb report --world-size N [--fsdp | --ddp] [--model NAME] [--batch N]
    memsave-nb plan --target-gb GB [--model NAME] [--gpu H100] [--precisions P,P]
                    [--micro-batches K,K] [--last-blocks N,N] [--save PLAN.json]

measures one training step of a built-in demo workload (``memsave_nb.zoo``), prints the per-layer
table and the peak's split, and with ``--out`` writes the standalone HTML report. A user mistake
(unknown model, missing device, bad batch size) is one line on stderr and exit code 2.

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
from .report import _add_tuner_arguments, _report, format_report  # noqa: F401 - format_report: public here too

PROG = "memsave-nb"
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from .. import zoo

    parser = _Parser(prog=PROG, description="See what a PyTorch training step keeps in memory.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    rep = sub.add_parser("report", help="measure a demo workload; print the per-layer table; write an HTML report",
                         description="Measure one training step of a built-in demo workload and report its memory.")
    rep.add_argument("--model", default="cnn", metavar="NAME", help=f"demo workload: {', '.join(zoo.NAMES)} (default: cnn)")
    rep.add_argument("--batch", type=_positive_int, default=None, metavar="N", help="batch size (default: the model's own)")
    rep.add_argument("--mode", choices=("real", "fake"), default=None,
                     help="real: run the step; fake: shapes and bytes only (default: real, fake for gpt-7b)")
    rep.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu or cuda (default: cpu)")
    rep.add_argument("--top", type=_positive_int, default=None, metavar="N",
                     help="show the N modules whose own ops save the most instead of every module")
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
