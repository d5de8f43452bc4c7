"""``memsave-nb report --target-gb GB [--headroom F] [--max-batch] [--max-seq]``: the target
section of the report (fits / does not fit, the largest batch or sequence that fits)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..target import DEFAULT_HEADROOM, Target, max_batch, max_seq_len

if TYPE_CHECKING:  # pragma: no cover
    from ..measure.result import Measurement
    from ..plan import Plan
    from ..workload import Workload


def cli_target_lines(workload: "Workload", plan: "Plan", measurement: "Measurement", args: Any) -> str:
    """The CLI's target section: the headroom line, fits / does not fit, max batch / sequence."""
    from memsave_nb.units import format_bytes

    if args.target_gb is None:
        raise PlanError("--max-batch and --max-seq need --target-gb")
    target = Target(args.target_gb, args.headroom if args.headroom is not None else DEFAULT_HEADROOM)
    lines = ["", target.line(), f"Peak {format_bytes(measurement.peak_bytes)}: {target.verdict(measurement.peak_bytes)}"]
    if args.max_batch:
        r = max_batch(workload, plan, target)
        lines.append(f"Max batch that fits: {r.value} (peak {format_bytes(r.peak_bytes or 0)}; {r.count} fake-mode probes)"
                     + (f"; {r.limit}" if r.limit else ""))
        lines += [f"  note: {n}" for n in r.notes]
    if args.max_seq:
        r = max_seq_len(workload, plan, target)
        lines.append(f"Max sequence length that fits: {r.value} (peak {format_bytes(r.peak_bytes or 0)}; {r.count} fake-mode probes)"
                     + (f"; limited by {r.limit}" if r.limit else ""))
        lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines) + "\n"
