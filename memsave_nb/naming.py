"""Name matching for plans: which module or parameter names a names field selects.

Below ``plan``, ``knobs`` and ``hf`` (all three use it); it imports none of them.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence

from memsave_nb.checkpointing import show
from memsave_nb.errors import PlanError, quoted

__all__ = ["ALL", "selects", "memsave_include"]

ALL = "*"


def selects(name: str, patterns: Sequence[str]) -> bool:
    """True when ``name`` is selected by ``patterns``: equal to one, below one (``"a.b"`` is below
    ``"a"``; everything is below the root ``""``), or matching one as an fnmatch pattern."""
    for pattern in patterns:
        if pattern == "" or name == pattern or name.startswith(pattern + "."):
            return True
        if fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def memsave_include(names: Sequence[str]) -> list[str] | None:
    """``include`` for :func:`memsave_nb.layers.convert`: ``None`` for all, else each name and
    everything below it (convert matches names exactly or as fnmatch patterns)."""
    if ALL in names or "" in names:
        return None
    out: list[str] = []
    for n in names:
        out += [n] if _is_pattern(n) else [n, n + ".*"]
    return out


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _names(value: Any, field_name: str) -> tuple[str, ...]:
    """Normalise a names field: bool True -> ("*",), False/None -> (), str -> (str,)."""
    if value is None or value is False:
        return ()
    if value is True:
        return (ALL,)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (Mapping, bytes, bytearray)):  # a dict's keys are not a list of names
        raise PlanError(f"plan field {quoted(field_name)}: expected a list of names, got {show(value)}")
    try:
        names = tuple(value)
    except TypeError:
        raise PlanError(f"plan field {quoted(field_name)}: expected names, got {show(value)}") from None
    for n in names:
        if not isinstance(n, str):
            raise PlanError(f"plan field {quoted(field_name)}: {show(n)} is not a name")
    return tuple(dict.fromkeys(names))  # drop duplicates, keep order
