"""The sequence lengths a user's data has, to size the step at its worst sample: a run dies on
its longest batch, not on the average one. From a ``datasets.Dataset`` column (token ids or
lengths), a list, or a file of lengths / a histogram."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import WorkloadError

MAX_LEN = 2**31 - 1
MAX_FILE_BYTES = 64 * 2**20  # a file of lengths, not a dataset


@dataclass(frozen=True)
class Lengths:
    """A histogram of sequence lengths: ``{length: samples}``."""

    counts: dict[int, int]

    @property
    def worst(self) -> int:
        return max(self.counts)

    @property
    def samples(self) -> int:
        return sum(self.counts.values())

    def quantile(self, q: float) -> int:
        """The smallest length at or above a share ``q`` of the samples."""
        need, seen = q * self.samples, 0
        for length in sorted(self.counts):
            seen += self.counts[length]
            if seen >= need:
                return length
        return self.worst

    def words(self) -> str:
        return (
            f"worst sample {self.worst} tokens (longest of {self.samples:,} samples; "
            f"median {self.quantile(0.5)}, 99th percentile {self.quantile(0.99)})"
        )


def _length(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__len__"):
        raise WorkloadError(f"{where}: expected a length or a sequence of token ids, got {type(value).__name__}")
    n = value if isinstance(value, int) else len(value)
    if not 1 <= n <= MAX_LEN:
        raise WorkloadError(f"{where}: a sequence length must be from 1 to {MAX_LEN}, got {str(n)[:20]}")
    return n


def lengths_of(values: Iterable[Any], where: str = "lengths") -> Lengths:
    """Lengths from ints (each a length) or sequences (each a tokenized sample)."""
    counts: dict[int, int] = {}
    for v in values:
        n = _length(v, where)
        counts[n] = counts.get(n, 0) + 1
    if not counts:
        raise WorkloadError(f"{where}: no samples")
    return Lengths(counts)


def dataset_lengths(dataset: Any, column: str) -> Lengths:
    """The lengths of ``dataset[column]`` (a ``datasets.Dataset``): token-id lists or int lengths."""
    names = list(getattr(dataset, "column_names", None) or ())
    if column not in names:
        shown = ", ".join(n[:30] for n in names[:10]) + (", ..." if len(names) > 10 else "")
        raise WorkloadError(f"dataset has no column {column[:40]!r}; its columns: {shown or 'none'}")
    return lengths_of(dataset[column], where=f"column {column[:40]!r}")


def worst_seq_len(dataset: Any, column: str) -> int:
    """The longest sample of ``dataset[column]``: the sequence length to size the step at."""
    return dataset_lengths(dataset, column).worst


def read_lengths(path: str | os.PathLike) -> Lengths:
    """A file of lengths: one length a line (or several, comma / space separated), or a histogram,
    ``LENGTH COUNT`` a line (``LENGTH: COUNT`` too); ``#`` starts a comment."""
    name = os.path.basename(os.fspath(path))[:40]
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise WorkloadError(
                f"{name}: over {MAX_FILE_BYTES // 2**20} MiB; give lengths or a histogram, not a dataset"
            )
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read lengths from {name}: {type(exc).__name__}") from None
    counts: dict[int, int] = {}
    for i, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.replace(":", " ").split() if ":" in line else None
        try:
            if fields is not None or (len(line.split()) == 2 and "," not in line):
                length, count = (int(v) for v in (fields or line.split()))
                pairs = [(length, count)]
            else:
                pairs = [(int(v), 1) for v in line.replace(",", " ").split()]
        except ValueError:
            raise WorkloadError(f"{name} line {i}: expected lengths or 'LENGTH COUNT', got {line[:40]!r}") from None
        for length, count in pairs:
            _length(length, f"{name} line {i}")
            if not 0 <= count <= MAX_LEN:
                raise WorkloadError(f"{name} line {i}: a count must be from 0 to {MAX_LEN}")
            if count:
                counts[length] = counts.get(length, 0) + count
    if not counts:
        raise WorkloadError(f"{name}: no lengths")
    return Lengths(counts)
