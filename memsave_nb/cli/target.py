"""``memsave-nb report --target-gb GB [--headroom F] [--max-batch] [--max-seq]``: the target's
answer (fits / does not fit, the largest batch or sequence that fits), printed beside the peak,
and its explanation, printed after the table. The verdict and the searches use one test
(``target.fit_of``): the allocator replay where there is one, else the headroom line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..target import DEFAULT_HEADROOM, RULE_80, Target, max_batch, max_seq_len, reserved_verdict

if TYPE_CHECKING:  # pragma: no cover
    from ..measure.result import Measurement
    from ..plan import Plan
    from ..workload import Workload


def cli_target(args: Any) -> Target:
    if args.target_gb is None:
        raise PlanError("--max-batch and --max-seq need --target-gb")
    return Target(args.target_gb, args.headroom if args.headroom is not None else DEFAULT_HEADROOM)


def verdict_line(target: Target, peak_bytes: int, who: str = "") -> str:
    return f"Target {target.label}{who}: {target.verdict(peak_bytes)}"


def _same_probe(workload: "Workload", plan: "Plan", measurement: "Measurement") -> "dict[int, Measurement] | None":
    """The report's own measurement as the max-batch search's probe at its batch, where it is that
    probe: a fake-mode steady state of a hub model, whose batch factory builds any size directly
    (a demo batch resized to its own size may be a copy: another input storage). Saves one step."""
    from ..hub.load import SyntheticBatch

    if not isinstance(workload.batch, SyntheticBatch) or measurement.mode != "fake" or not measurement.steady_state:
        return None
    return {plan.batch_size or workload.batch.batch_size: measurement}


def cli_target_lines(
    workload: "Workload", plan: "Plan", measurement: "Measurement", args: Any
) -> tuple[tuple[str, ...], str]:
    """``(answer lines, explanation)``: the verdict and max batch / sequence, then the headroom line."""
    from memsave_nb.units import format_bytes

    target = cli_target(args)
    replayed = reserved_verdict(target, measurement)  # None where no allocator replay exists
    answer = [replayed.lines()[0] if replayed else verdict_line(target, measurement.peak_bytes)]
    searched: list[Any] = []
    if args.max_batch:
        r = max_batch(workload, plan, target, measured=_same_probe(workload, plan, measurement))
        answer.append(
            f"Max batch that fits: {r.value} (peak {format_bytes(r.peak_bytes or 0)}; {r.count} fake-mode probes, "
            f"{r.rule})" + (f"; {r.limit}" if r.limit else "")
        )
        answer += [f"  note: {n}" for n in r.notes]  # caveats on where the boundary lies, beside it
        searched.append(r)
    if args.max_seq:
        r = max_seq_len(workload, plan, target)
        answer.append(
            f"Max sequence length that fits: {r.value} (peak {format_bytes(r.peak_bytes or 0)}; "
            f"{r.count} fake-mode probes, {r.rule})" + (f"; limited by {r.limit}" if r.limit else "")
        )
        answer += [f"  note: {n}" for n in r.notes]
        searched.append(r)
    rules = {r.rule for r in searched}
    if replayed:  # its sources after the searches' answers, which used the same test (target.fit_of)
        answer += replayed.lines()[1:]
        rule = ""
        if any(RULE_80 in r for r in rules):  # a probe without a replay fell back to the headroom line
            rule = "; a search probe without a replay: " + target.line()
        elif args.headroom is not None:
            rule = "; --headroom applies only where no allocator replay exists (none here)"
        return tuple(answer), (
            "\nTarget verdict and searches: the step's allocations replayed through a model of "
            "torch's CUDA caching allocator (docs/allocator.md), the 80% rule does not apply" + rule + "\n"
        )
    return tuple(answer), "\n" + target.line() + " (80% rule: no allocator replay for this step)\n"
