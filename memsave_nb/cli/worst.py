"""``--worst-of 512,2048,...`` / ``--seq-lens-from FILE``: size the step at the data's longest
sample (a run dies on its longest batch). Sets the sequence length before the model is built;
the answer says which sample it is."""

from __future__ import annotations

import argparse

from ..errors import MemsaveError


def add_worst_arguments(p: argparse.ArgumentParser) -> None:
    from .args import _csv_ints

    p.add_argument(
        "--worst-of",
        type=_csv_ints,
        default=None,
        metavar="T,T",
        help="Hugging Face models: the data's sequence lengths; the step is sized at the longest",
    )
    p.add_argument(
        "--seq-lens-from",
        default=None,
        metavar="FILE",
        help="Hugging Face models: a file of sequence lengths (one a line) or a histogram ('LENGTH COUNT' "
        "a line); the step is sized at the longest",
    )


def resolve_worst(args: argparse.Namespace):
    """The data's lengths (``hub.seq_lengths.Lengths``) with ``args.seq_len`` set to the worst, or None."""
    worst_of, from_file = getattr(args, "worst_of", None), getattr(args, "seq_lens_from", None)
    if worst_of is None and from_file is None:
        return None
    if worst_of is not None and from_file is not None:
        raise MemsaveError("give --worst-of or --seq-lens-from, not both")
    if args.seq_len is not None:
        raise MemsaveError("--worst-of / --seq-lens-from set the sequence length; drop --seq-len")
    from .workload import is_demo

    if is_demo(args.model):
        raise MemsaveError(
            f"--worst-of / --seq-lens-from size a Hugging Face model's sequence; {args.model!r} is a "
            "demo model (its batch keeps its own length)"
        )
    from ..hub.seq_lengths import lengths_of, read_lengths

    lengths = lengths_of(worst_of, "--worst-of") if worst_of is not None else read_lengths(str(from_file))
    args.seq_len = lengths.worst
    return lengths
