"""Byte sizes as people read them (binary units). Shared by the engine-side pieces (target,
planner) and the UI, so neither reaches into the other."""

from __future__ import annotations

import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None, precision: int = 1) -> str:
    """``0 -> "0 B"``, ``1536 -> "1.5 KiB"``, ``47339716 -> "45.1 MiB"``; ``None -> "-"``."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    unit = 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.{precision}f} {_UNITS[unit]}"
