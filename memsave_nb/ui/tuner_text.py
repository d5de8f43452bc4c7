"""The "Fit a GPU" panel's words: why max seq len cannot run, the knob hints when nothing fits,
a search's caveats. Plain functions of their arguments, so the panel keeps to its widgets."""

from __future__ import annotations

import html
from typing import Any, Sequence

from memsave_nb.target import Target

from .format import format_bytes
from .pareto_figure import FITS_COLOR, MISS_COLOR


def _floor(m: Any) -> int:
    """What no checkpointing removes from the peak: parameters, gradients and optimizer state."""
    s = m.peak_split
    return s.parameters + s.gradients + s.optimizer_state


def _hints_html(hints: Sequence[Any], target: Target) -> str:
    """None fits: the knobs that would on their own (green) or come closest, each with its peak."""
    if not hints:
        return ""
    rows = []
    for h in sorted(hints, key=lambda h: (not h.fits, h.peak_bytes)):
        cls, color = ("memsave-fits", FITS_COLOR) if h.fits else ("memsave-nofit", MISS_COLOR)
        rows.append(
            f"<li class='memsave-hint {cls}'><b>{html.escape(h.knob)}</b>: {html.escape(h.change)} &rarr; peak "
            f"<b>{format_bytes(h.peak_bytes)}</b>, <span style='color:{color}'>"
            f"{html.escape(h.verdict or target.verdict(h.peak_bytes))}</span></li>"
        )
    head = (
        "None of the plans fits, but these knobs do on their own (each measured in fake mode):"
        if any(h.fits for h in hints)
        else "Nothing fits, not even one knob on its own; the closest each reaches:"
    )
    return f"<div><b>{head}</b><ul style='margin:2px 0'>{''.join(rows)}</ul></div>"


def _hints_count(hints: Sequence[Any]) -> str:
    n = sum(h.fits for h in hints)
    return f"; {n} knob{'s' if n != 1 else ''} would on {'their' if n != 1 else 'its'} own (below)" if n else ""


def _notes_html(result: Any) -> str:
    """A search result's caveats (e.g. the optimizer's single-tensor step in fake mode, where a GPU
    runs foreach and needs more), one small line each under the result."""
    return "".join(
        f"<br><small class='memsave-search-note' style='color:#b8860b'>note: {html.escape(n)}</small>"
        for n in result.notes
    )
