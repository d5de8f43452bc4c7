"""Human-readable numbers, shared by the CLI table, the HTML report and the figures' labels.

Bytes use binary units (KiB, MiB, GiB), as memory sizes usually are.
"""

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


def format_delta_bytes(n: int | float | None, precision: int = 1) -> str:
    """A signed byte change: ``+1.0 MiB``, ``-512 B``, ``0 B``."""
    if n is None:
        return "-"
    text = format_bytes(n, precision)
    return f"+{text}" if n > 0 else text


def format_share(fraction: float | None, precision: int = 1) -> str:
    """``0.3969 -> "39.7%"``."""
    if fraction is None:
        return "-"
    return f"{100.0 * fraction:.{precision}f}%"


def format_count(n: int | None) -> str:
    """Parameter counts with thousands separators: ``803840 -> "803,840"``."""
    if n is None:
        return "-"
    return f"{n:,}"


def format_seconds(seconds: float | None) -> str:
    """``0.0123 -> "12.3 ms"``, ``1.5 -> "1.50 s"``, ``None -> "-"`` (fake mode has no time)."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_shape(shape: tuple[int, ...] | None) -> str:
    """``(256, 1024) -> "[256, 1024]"``; ``None -> "-"``."""
    if shape is None:
        return "-"
    return "[" + ", ".join(str(d) for d in shape) + "]"


# JavaScript twin of format_bytes for Bokeh axes (CustomJSTickFormatter).
BYTES_TICK_JS = """
const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
let v = Math.abs(tick), u = 0;
while (v >= 1024 && u < units.length - 1) { v /= 1024; u += 1; }
const sign = tick < 0 ? "-" : "";
return u == 0 ? sign + v.toFixed(0) + " B" : sign + v.toFixed(1) + " " + units[u];
"""
