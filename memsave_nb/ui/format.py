"""Human-readable numbers, shared by the CLI table, the HTML report and the figures' labels.

Bytes use binary units (KiB, MiB, GiB), as memory sizes usually are.
"""

from __future__ import annotations


from ..measure.result import subtree_params
from ..units import _UNITS, format_bytes  # noqa: F401  (re-exported: the UI's formatting lives here)


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
// One unit for the whole axis (from its largest tick) and enough decimals to tell neighbouring
// ticks apart: close peaks (11.85 vs 11.90 MiB) must not all read "11.9 MiB".
const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
const top = Math.max(...ticks.map(t => Math.abs(t)));
let u = 0, d = 1;
while (top / d >= 1024 && u < units.length - 1) { d *= 1024; u += 1; }
const step = ticks.length > 1 ? Math.abs(ticks[1] - ticks[0]) / d : 1;
const dec = u == 0 ? 0 : Math.max(1, Math.min(6, Math.ceil(-Math.log10(step || 1))));
const sign = tick < 0 ? "-" : "";
return sign + (Math.abs(tick) / d).toFixed(dec) + " " + units[u];
"""


def format_flops(n: int | None) -> str:
    """``1218969600 -> "1.22 GFLOP"`` (decimal units, as FLOP counts usually are)."""
    if not n:
        return "-"
    value, unit = float(n), 0
    prefixes = ("", "k", "M", "G", "T", "P", "E")
    while value >= 1000 and unit < len(prefixes) - 1:
        value /= 1000
        unit += 1
    return f"{value:.2f} {prefixes[unit]}FLOP" if unit else f"{int(value)} FLOP"


# -- tables ------------------------------------------------------------------------------------
LAYER_COLUMNS = ("Module", "Type", "Output shape", "Trainable params", "Saved activations", "Share")


def layer_table(measurement, *, top: int | None = None, baseline=None) -> tuple[list[str], list[list[str]]]:
    """The per-layer table as text cells: every module in ``named_modules()`` order, indented by
    depth, with trainable parameters summed over its subtree and saved activations rolled up.

    ``top=N`` keeps instead the N modules whose own ops save the most, largest first: leaves, and
    parents whose forward runs ops of its own (an attention's matmuls and softmax, a residual
    add), shown as "name (own ops)" with only those bytes, so no byte is listed twice.
    With a ``baseline`` measurement a "vs baseline" column is added.
    """
    total = measurement.saved_bytes
    trainable = {name: t for name, (t, _) in subtree_params(measurement.modules).items()}
    own_only = set()
    if top is not None:
        ranked = [m for m in measurement.modules if m.is_leaf or m.saved_bytes_own > 0]
        chosen = sorted(ranked, key=lambda m: -m.saved_bytes_own)[: max(0, top)]
        own_only = {m.name for m in chosen if not m.is_leaf}
        indent = False
    else:
        chosen = list(measurement.modules)
        indent = True
    base = {m.name: m.saved_bytes for m in baseline.modules} if baseline is not None else None
    headers = list(LAYER_COLUMNS) + (["vs baseline"] if base is not None else [])
    rows = []
    for m in chosen:
        name = m.name or "(model)"
        saved = m.saved_bytes
        if indent:
            name = "  " * m.depth + name
        if m.name in own_only:
            name, saved = f"{name} (own ops)", m.saved_bytes_own
            base_saved = (
                {x.name: x.saved_bytes_own for x in baseline.modules}.get(m.name, saved)
                if baseline is not None
                else saved
            )
        else:
            base_saved = base.get(m.name, saved) if base is not None else saved
        share = saved / total if total else 0.0
        row = [
            name,
            m.type_name,
            format_shape(m.output_shape),
            format_count(trainable.get(m.name, m.trainable_params)),
            format_bytes(saved),
            format_share(share),
        ]
        if base is not None:
            row.append(format_delta_bytes(saved - base_saved))
        rows.append(row)
    return headers, rows


def split_table(measurement) -> tuple[list[str], list[list[str]]]:
    """The peak's split as text cells: category, bytes, share of the peak."""
    peak = measurement.peak_bytes
    rows = []
    for category, value in measurement.peak_split.as_dict().items():
        rows.append([category.replace("_", " "), format_bytes(value), format_share(value / peak if peak else 0.0)])
    return ["Category", "Bytes", "Share of peak"], rows


def render_table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """A plain monospaced table; columns in ``right`` (indices) are right-aligned."""
    right = right or set()
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        out = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# -- step times: median, spread, and whether a change is above the noise ------------------------
def time_spread(m) -> tuple[float | None, float | None, float | None, int]:
    """``(median, min, max, n)`` of a measurement's timed steps (``step_seconds_all``)."""
    times = [t for t in (getattr(m, "step_seconds_all", ()) or ()) if t is not None]
    median = getattr(m, "step_seconds", None)
    if not times:
        return median, median, median, (1 if median is not None else 0)
    return median, min(times), max(times), len(times)


def format_time_spread(m) -> str:
    """``"12.3 ms (11.9-13.0 ms, 3 runs)"``; a single run says so (no spread to judge by)."""
    median, lo, hi, n = time_spread(m)
    if median is None:
        return "-"
    if n < 2:
        return f"{format_seconds(median)} (1 run)"
    return f"{format_seconds(median)} ({format_seconds(lo)}–{format_seconds(hi)}, {n} runs)"


def time_change(now, before) -> str:
    """The step time of ``now`` against ``before``: ``"1.42x"``, or ``"same"`` when the change is
    within the runs' own spread (or fewer than 3 runs on either side leave no spread to judge by)."""
    a, a_lo, a_hi, na = time_spread(now)
    b, b_lo, b_hi, nb = time_spread(before)
    if a is None or b is None or not b:
        return ""
    ratio = a / b
    if na < 3 or nb < 3:
        return f"{ratio:.2f}x (too few runs to judge)"
    assert a_lo is not None and a_hi is not None and b_lo is not None and b_hi is not None  # timed runs: n >= 3
    noise = max((a_hi - a_lo) / a if a else 0.0, (b_hi - b_lo) / b)
    if abs(ratio - 1.0) <= noise or (a_lo <= b_hi and b_lo <= a_hi):
        return "same (within noise)"
    return f"{ratio:.2f}x"
