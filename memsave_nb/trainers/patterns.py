"""Regexes from a config, compiled only when they cannot backtrack without end (issue 38).

Python's ``re`` has no timeout, and ``(a+)+$`` over a 40-character name takes longer than the
universe. So a pattern is refused, before it meets any name, when it is longer than
:data:`MAX_PATTERN`; when a repeat that can run more than once holds another repeat or an
alternation (nested quantifiers, the usual shape of catastrophic backtracking); when it holds
more than :data:`MAX_REPEATS` open repeats; or when it has backreferences or lookarounds. What is
left matches in time polynomial in a name's length, and parameter names are short. axolotl's
``unfrozen_parameters`` need none of the refused forms.
"""

from __future__ import annotations

import re
from typing import Any

from memsave_nb.checkpointing import show

from .safe_read import TrainerConfigError

try:  # Python 3.11+: the parser re.compile itself runs
    from re import _constants as _c, _parser as _p  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

__all__ = ["MAX_PATTERN", "MAX_REPEATS", "compile_bounded"]

MAX_PATTERN = 500
MAX_REPEATS = 3  # `.*` x 3 over a 100-character name: 10^6 steps at worst
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", _c.MAX_REPEAT)}
_REFUSED = {
    _c.GROUPREF: "a backreference",
    _c.ASSERT: "a lookaround",
    _c.ASSERT_NOT: "a lookaround",
    getattr(_c, "GROUPREF_EXISTS", _c.GROUPREF): "a conditional group",
}


def compile_bounded(pattern: Any, key: str) -> re.Pattern:
    """``re.compile(pattern)`` for a pattern without nested repeats, backreferences or lookarounds."""
    if not isinstance(pattern, str):
        raise TrainerConfigError(f"{key}: a regex must be text, got {show(pattern)}")
    if len(pattern) > MAX_PATTERN:
        raise TrainerConfigError(f"{key}: a regex over {MAX_PATTERN} characters is refused")
    try:
        parsed = _p.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise TrainerConfigError(f"{key}: bad regex {show(pattern, 40)}: {str(exc)[:80]}") from None
    why = _unbounded(parsed, inside_repeat=False)
    if not why and _count_repeats(parsed) > MAX_REPEATS:
        why = f"more than {MAX_REPEATS} open repeats (time grows as the name's length to that power)"
    if why:
        raise TrainerConfigError(f"{key}: regex {show(pattern, 40)} has {why}, which can backtrack without end")
    return re.compile(pattern)


def _count_repeats(items: Any) -> int:
    n = 0
    for op, arg in items:
        if op in _REPEATS:
            n += (arg[0] != arg[1]) + _count_repeats(arg[2])
        elif op is _c.SUBPATTERN:
            n += _count_repeats(arg[-1])
        elif op is _c.BRANCH:
            n += max((_count_repeats(b) for b in arg[1]), default=0)
    return n


def _unbounded(items: Any, inside_repeat: bool) -> str | None:
    """Why a parsed pattern may take exponential time, or None."""
    for op, arg in items:
        if op in _REFUSED:
            return _REFUSED[op]
        if op in _REPEATS:
            lo, hi, sub = arg
            if inside_repeat and hi != lo:
                return "a repeat inside a repeat"
            why = _unbounded(sub, inside_repeat or hi > 1)  # `(...)?` runs its body once at most
            if why:
                return why
        elif op is _c.SUBPATTERN:
            why = _unbounded(arg[-1], inside_repeat)
            if why:
                return why
        elif op is _c.BRANCH:
            if inside_repeat:
                return "an alternation inside a repeat"
            for branch in arg[1]:
                why = _unbounded(branch, inside_repeat)
                if why:
                    return why
    return None
