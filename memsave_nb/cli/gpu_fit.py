"""``report --fit-gpus``: which GPUs of the catalogue (``planner.roofline.GPUS``) the measured step
fits, and at what max batch on each (fake-mode bisection): the answer by GPU name."""

from __future__ import annotations

from typing import Any


def gpu_targets(headroom: float | None) -> list[tuple[str, Any]]:
    """``(key, Target)`` for every GPU of the catalogue, smallest memory first."""
    from ..planner.roofline import GPUS
    from ..target import DEFAULT_HEADROOM, Target

    h = DEFAULT_HEADROOM if headroom is None else headroom
    return [
        (key, Target(d.memory_gb, h, name=f"{key} {d.memory_gb:g} GB"))
        for key, d in sorted(GPUS.items(), key=lambda kv: (kv[1].memory_gb, kv[0]))
    ]


def gpu_fit_rows(workload, plan, measurement, headroom: float | None) -> list[dict]:
    """Per GPU: the verdict at the measured peak and the largest batch that fits (its peak)."""
    from ..target import max_batch
    from .json_out import verdict_of
    from .target import _same_probe

    rows, known, by_size = [], _same_probe(workload, plan, measurement), {}
    for key, target in gpu_targets(headroom):
        if target.usable_bytes not in by_size:  # two 24 GB cards: one search
            by_size[target.usable_bytes] = max_batch(workload, plan, target, measured=dict(known) if known else None)
        r = by_size[target.usable_bytes]
        rows.append(
            {
                "gpu": key,
                "memory_gb": target.gb,
                "usable_bytes": target.usable_bytes,
                **{k: v for k, v in verdict_of(target, measurement).items() if k in ("fits", "verdict", "rule")},
                "max_batch": r.value,
                "max_batch_peak_bytes": r.peak_bytes,
                "limit": r.limit or None,
            }
        )
    return rows


def gpu_fit_lines(rows: list[dict]) -> list[str]:
    """The answer lines: one per GPU, those it fits named first in a summary line."""
    fits = [r["gpu"] for r in rows if r["fits"]]
    head = f"Fits on: {', '.join(fits)}" if fits else "Fits on none of the catalogue's GPUs"
    return [head + " (--fit-gpus)"] + [
        f"  {r['gpu']}: {r['verdict']}; max batch {r['max_batch']}"
        + (f" ({r['limit']})" if r["limit"] and r["max_batch"] else "")
        for r in rows
    ]
