"""``report --explain``: the peak explained, as the answer's second paragraph: what the step holds
at the peak (the split's largest parts), which layers saved the most for backward, and which single
knob (``planner.what_fits``: each tried on its own, measured) frees the most."""

from __future__ import annotations

from typing import Any

TOP_LAYERS = 3


def explain_lines(workload: Any, plan: Any, measurement: Any, target: Any = None) -> list[str]:
    """The paragraph's lines; the knob line only with a target (the knobs are sized against it)."""
    from ..units import format_bytes

    m = measurement
    parts = sorted(((k, v) for k, v in m.peak_split.as_dict().items() if v), key=lambda kv: -kv[1])
    held = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)} ({v / m.peak_bytes:.0%})" for k, v in parts[:3])
    lines = [f"Why the peak: during {m.peak_phase} the step holds {held}"]
    leaves = sorted((s for s in m.modules if s.name and s.saved_bytes_own), key=lambda s: -s.saved_bytes_own)
    if leaves and m.saved_bytes:
        top = ", ".join(f"{s.name} ({s.type_name}) {format_bytes(s.saved_bytes_own)}" for s in leaves[:TOP_LAYERS])
        lines.append(f"  saved for backward most by: {top} (of {format_bytes(m.saved_bytes)} saved in all)")
    if target is not None:
        from ..planner.what_fits import what_would_fit

        hints = what_would_fit(workload, plan, target, mode="fake", gpus=False)
        if hints:
            best = min(hints, key=lambda h: h.peak_bytes)
            freed = m.peak_bytes - best.peak_bytes
            lines.append(
                f"  the single knob that frees the most: {best.knob}: {best.change} -> peak "
                f"{format_bytes(best.peak_bytes)} ({format_bytes(max(freed, 0))} less), {target.verdict(best.peak_bytes)} (80% rule)"
            )
        else:
            lines.append("  no single knob tried here lowers the peak")
    return lines
