"""One verdict for every screen of the explorer: ``target.fit_of`` (the allocator replay's predicted
reserved memory + CUDA context + communication buffers against the whole GPU; the 80% rule only
where the step has no replay, and then it says so), the test the CLI, the planner and the searches
use. The "Fit a GPU" panel, the header, the Results table and the timeline all read it from here,
so no two of them can disagree (issue 40)."""

from __future__ import annotations

import html
import threading
from collections import OrderedDict
from typing import Any

from memsave_nb.target import (
    COMM_BUFFER_SOURCE,
    CUDA_CONTEXT_SOURCE,
    HEADROOM_SOURCE,
    PRESETS_GB,
    RULE_REPLAY,
    Fit,
    Target,
    fit_of,
    plausible_preset_gb,
    replay_line_bytes,
)

from .format import format_bytes

__all__ = [
    "fit_for",
    "line_bytes",
    "verdict_text",
    "parts_html",
    "rule_html",
    "reserved_text",
    "opening_gb",
    "show_header_verdict",
    "show_reserved",
]

# (id(measurement), target) -> (measurement, Fit): a refresh asks for the same verdict several times
_CACHE: "OrderedDict[tuple[int, Target], tuple[Any, Fit]]" = OrderedDict()
_CACHE_SIZE = 32
_LOCK = threading.Lock()


def fit_for(target: Target, measurement: Any) -> Fit:
    """``fit_of(target, measurement)`` (with the allocator setting that would fit, where one does),
    remembered for the last few (measurement, target) pairs: one replay per pair, not per widget."""
    key = (id(measurement), target)
    with _LOCK:  # explorers' worker threads and the kernel's share it
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is measurement:
            _CACHE.move_to_end(key)
            return hit[1]
    fit = fit_of(target, measurement)
    with _LOCK:
        _CACHE[key] = (measurement, fit)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return fit


def line_bytes(target: Target, fit: Fit) -> int:
    """The line the verdict draws on a timeline of the step: what the replayed step may reserve
    (the GPU less the CUDA context), or the 80% headroom line where there is no replay."""
    return replay_line_bytes(target) if fit.replay is not None else target.usable_bytes


def verdict_text(target: Target, fit: Fit) -> str:
    """``fits (...)`` / ``does not fit (...)``, naming the rule (``Fit.verdict``: the CLI's figures)."""
    return fit.verdict(target)


def parts_html(fit: Fit) -> str:
    """The verdict's parts, one small line each with its source: predicted reserved (and
    allocated), the CUDA context, communication buffers; or why the 80% rule decided."""
    if fit.replay is None:
        return (
            f"<small class='memsave-verdict-parts'>peak {format_bytes(fit.peak_bytes)} against 80% of the GPU: "
            f"no allocator replay for this step, so the 80% rule ({html.escape(HEADROOM_SOURCE)})</small>"
        )
    r = fit.replay
    conf = f", PYTORCH_CUDA_ALLOC_CONF={r.alloc_conf}" if r.alloc_conf else ""
    rows = [
        f"predicted reserved <b class='memsave-verdict-reserved'>{format_bytes(r.reserved_bytes)}</b> "
        f"(caching-allocator model{html.escape(conf)}; allocated {format_bytes(r.allocated_bytes)}, "
        f"tensors at the peak {format_bytes(fit.peak_bytes)})",
        f"+ CUDA context {format_bytes(r.context_bytes)} ({html.escape(CUDA_CONTEXT_SOURCE)})",
    ]
    if r.communicators:
        rows.append(
            f"+ communication buffers {format_bytes(r.comm_bytes)} ({r.communicators} x "
            f"{html.escape(COMM_BUFFER_SOURCE)})"
        )
    if r.fragmentation_only:
        rows.append(
            "fragmentation alone makes it not fit: the allocations fit, the cached segments do not"
            + (f"; PYTORCH_CUDA_ALLOC_CONF={html.escape(r.fix)} fits" if r.fix else "; no setting tried fits")
        )
    elif r.fix:
        rows.append(f"PYTORCH_CUDA_ALLOC_CONF={html.escape(r.fix)} fits")
    if r.fits and r.total_bytes > r.target.total_bytes:
        rows.append(
            "the replay under this GPU's size fits: torch frees cached segments when it would run out, "
            "so the step reserves less than the uncapped figure above"
        )
    return "<small class='memsave-verdict-parts'>" + "<br>".join(rows) + "</small>"


def rule_html(target: Target, fit: Fit) -> str:
    """The line plans must stay under, and by which rule."""
    if fit.replay is not None:
        return (
            f"<small class='memsave-rule'>rule: <b>{RULE_REPLAY}</b>. The step's predicted reserved memory must stay "
            f"under <b>{format_bytes(replay_line_bytes(target))}</b> ({html.escape(target.label)} less the CUDA "
            "context); the headroom setting applies only where a step has no replay</small>"
        )
    return (
        f"<small class='memsave-rule'>rule: <b>80% rule</b> (no allocator replay for this step). Plans must stay "
        f"under <b>{format_bytes(target.usable_bytes)}</b> ({target.headroom:.0%} of {html.escape(target.label)})</small>"
    )


def reserved_text(measurement: Any) -> str:
    """``"reserved 22.2 GiB"`` from the allocator model ("" without a replay); short, so the header's
    memory line stays one line at 1400 px (the fragmentation is in the tooltip)."""
    r = getattr(measurement, "reserved", None)
    if r is None or not r.ops:
        return ""
    return f"reserved {format_bytes(r.max_reserved_bytes)}"


def opening_gb(measurement: Any) -> float | None:
    """The smallest preset GPU the step fits by ``fit_of``; where none does, the smallest that
    holds what no checkpointing or micro-batching removes (weights, gradients, optimizer state),
    under the same line; None when no preset holds even that."""
    if getattr(measurement, "reserved", None) is None or not measurement.reserved.ops:
        return plausible_preset_gb(measurement)  # no replay: the 80% rule's choice
    for gb in sorted(PRESETS_GB):
        if fit_of(Target(gb), measurement, fixes=False).fits:
            return float(gb)
    split = measurement.peak_split
    floor = split.parameters + split.gradients + split.optimizer_state
    fitting = [gb for gb in PRESETS_GB if floor <= replay_line_bytes(Target(gb))]
    return float(min(fitting)) if fitting else None


def show_header_verdict(label: Any, target: Target | None, measurement: Any, max_batch: int | None) -> None:
    """The explorer header's ``✔ fits (...)`` / ``✘ does not fit (...)`` label (an ipywidgets
    Label): the panel's verdict, its parts in the tooltip; hidden without a target."""
    for cls in ("memsave-fits", "memsave-nofit"):
        label.remove_class(cls)
    if target is None:
        label.value, label.tooltip, label.layout.display = "", None, "none"
        return
    fit = fit_for(target, measurement)
    label.add_class("memsave-fits" if fit.fits else "memsave-nofit")
    label.value = f"{'✔' if fit.fits else '✘'} {verdict_text(target, fit)}" + (
        f" · max batch {max_batch}" if max_batch is not None else ""
    )
    r = fit.replay
    label.tooltip = (
        f"predicted reserved {r.reserved_bytes:,} B + CUDA context {r.context_bytes:,} B against "
        f"{target.total_bytes:,} B ({target.label})"
        if r is not None
        else f"peak {fit.peak_bytes:,} B against the headroom line {target.usable_bytes:,} B "
        f"({target.headroom:.0%} of {target.label}; no allocator replay)"
    )
    label.style.text_color = "#2ca02c" if fit.fits else "#d62728"
    label.layout.display = ""


def show_reserved(label: Any, measurement: Any) -> None:
    """The header's predicted reserved memory beside the allocated peak (hidden without a replay)."""
    label.value = reserved_text(measurement)
    r = getattr(measurement, "reserved", None)
    label.tooltip = (
        (
            "predicted torch.cuda.max_memory_reserved(): the step's allocations replayed through a model "
            f"of PyTorch's caching allocator (docs/allocator.md); fragmentation at the peak "
            f"{format_bytes(r.fragmentation_bytes)}"
        )
        if label.value and r is not None
        else None
    )
    label.layout.display = "" if label.value else "none"
