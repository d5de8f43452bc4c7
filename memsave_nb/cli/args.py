"""The command line's argument parsing: one-line usage errors, bounded numbers.

Every number a flag takes is checked here, before anything is built or measured: a hostile value
(``inf``, ``nan``, ``1e308``, a batch of 10**20) is one line on stderr, never a traceback later."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import NoReturn

from ..errors import MemsaveError
from ..vocabulary import PRECISIONS

# the largest count a flag takes: torch sizes are int64, and anything past int32 is a typo here
MAX_COUNT = 2**31 - 1
# the largest GPU a target may name: 1 PB (a float past this overflows the byte counts)
MAX_GB = 1e6


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(_cut_values(message))


def _cut_values(message: str, keep: int = 40, limit: int = 200) -> str:
    """argparse quotes the user's value whole (in quotes, or bare after "unrecognized arguments:");
    a 200,000-character value is cut to ``keep``, and the line (a long list of choices) to ``limit``."""
    message = re.sub(r"'([^']{%d})[^']+'" % keep, lambda m: f"'{m.group(1)}...'", message)
    message = re.sub(r"(\S{%d})\S+" % keep, lambda m: f"{m.group(1)}...", " ".join(message.split()))
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:40]!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_COUNT}, got {text[:40]}")
    return value


MAX_ACCUMULATE = 64  # each micro-step is run and measured; the peak stops changing after the second


def _accumulate(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_ACCUMULATE:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_ACCUMULATE} micro-batches (each one runs; from the second on "
            f"the peak no longer changes), got {value}"
        )
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text[:40]}")
    return value


def _gb(text: str) -> float:
    """A GPU size in GB: finite, above 0, at most 1 PB."""
    value = _number(text)
    if not 0 < value <= MAX_GB:
        raise argparse.ArgumentTypeError(f"expected GB above 0 and at most {MAX_GB:g}, got {text[:40]}")
    return value


def _fraction(text: str) -> float:
    """A share of the target in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text[:40]}")
    return value


def check_writable(path: str, flag: str) -> None:
    """A file the command will write: its folder must exist and take files (checked before the search)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise MemsaveError(f"{flag} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        raise MemsaveError(f"{flag} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise MemsaveError(f"{flag} {path}: cannot write in {folder}")


# -- lists of values (plan, --compare, --worst-of) ----------------------------------------------


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text[:40]!r}") from None
    if not values or min(values) < 1 or max(values) > MAX_COUNT:
        raise argparse.ArgumentTypeError(
            f"expected positive numbers up to {MAX_COUNT} separated by commas, got {text[:40]!r}"
        )
    return values


def _csv_precisions(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in PRECISIONS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"precisions are {', '.join(PRECISIONS)}; got {text[:40]!r}")
    return values
