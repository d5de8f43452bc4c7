"""Why a selective checkpoint on one region changed what the step keeps, in bytes the user can
check: the SAC panel shows these lines under its op rows.

Recomputing an op can *raise* memory (issue 42: "recompute ``aten.relu`` in the MLP demo's
``3``: +1.0 MiB"). Measured: the region's input (``2``'s ``addmm`` output, 256 x 1024 fp32 =
1,048,576 B) is now kept so that the region can be run again in backward, while the op's own
output is still kept because the next layer saves it for its own backward (so recomputing it
frees nothing), and the checkpoint stashes the CPU generator's state (5,056 B) to replay dropout.
Each of those is read from the two Measurements (per module and op), never guessed."""

from __future__ import annotations

from typing import Any, Iterable

from memsave_nb.measure.tracker import RNG_STATE_OP

from .format import format_bytes, format_delta_bytes


def _inside(module: str, region: str) -> bool:
    return region == "" or module == region or module.startswith(region + ".")


def _by_module_op(measurement: Any) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for module, op, _calls, saved in measurement.module_ops:
        out[(module, op)] = out.get((module, op), 0) + int(saved)
    return out


def sac_cost_lines(
    region: str, plan: Any, measurement: Any, baseline: Any, recomputed: Iterable[str] = ()
) -> list[str]:
    """Plain-text lines: the change in kept bytes this region's plan caused, split into the region's
    own ops, the RNG state the checkpoint stashes, what outside the region is now kept longer (only
    when the plan on display checkpoints this region alone, so the change is this region's), and
    each recomputed op that is still kept. Empty when nothing changed or the plan does not
    checkpoint ``region``."""
    regions = dict(getattr(plan, "active_regions", None) or {}) if plan is not None else {}
    if region not in regions or measurement is baseline:
        return []
    now, base = _by_module_op(measurement), _by_module_op(baseline)
    keys = set(now) | set(base)
    delta = {k: now.get(k, 0) - base.get(k, 0) for k in keys}
    total = measurement.saved_bytes - baseline.saved_bytes
    inside = sum(d for (m, op), d in delta.items() if _inside(m, region) and op != RNG_STATE_OP)
    rng = sum(now.get(k, 0) for k in keys if k[1] == RNG_STATE_OP and _inside(k[0], region))
    lines = [
        f"kept for backward: {format_delta_bytes(total)} against eager ({total:+,} B): "
        f"{format_delta_bytes(inside)} in this region's ops"
        + (f", {rng:,} B the random-number state the checkpoint stashes to replay dropout" if rng else "")
    ]
    if len(regions) == 1:  # only this region is planned: every change outside it is this region's doing
        grew = sorted(((d, m, op) for (m, op), d in delta.items() if d > 0 and not _inside(m, region)), reverse=True)
        for d, m, op in grew[:3]:
            lines.append(
                f"+{format_bytes(d)} ({d:,} B) outside the region: the output of {op} in {m or '(model)'} "
                "is kept now, as the region's input, so that the region can be run again in backward"
            )
    ops_now: dict[str, int] = {}
    for (m, op), saved in now.items():
        if _inside(m, region):
            ops_now[op] = ops_now.get(op, 0) + saved
    for op in recomputed:
        kept = ops_now.get(op, 0)
        if kept:
            lines.append(
                f"{op} is recomputed but still kept ({format_bytes(kept)}): a later op saves its output "
                "for its own backward, so recomputing it frees nothing"
            )
    return lines
