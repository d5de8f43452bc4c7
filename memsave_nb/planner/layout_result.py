"""What the layout planner hands back: its candidates (a layout with its single-device choices,
estimated peak and step time) and the result (ranked candidates, the front, the chosen layout and
its per-rank re-measurement). The search is ``layout.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memsave_nb.checkpointing import PlanError
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan
from memsave_nb.planner.links import Fabric
from memsave_nb.planner.roofline import Device
from memsave_nb.target import Target
from memsave_nb.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.parallel.result import ParallelMeasurement

__all__ = ["LayoutCandidate", "LayoutResult"]


@dataclass(frozen=True)
class LayoutCandidate:
    spec: ParallelSpec
    regions: str | None  # checkpointing kind on every block, None: none
    precision: str | None
    micro_batch: int  # per rank
    accumulation: int
    plan: Plan  # every choice, the spec included (plan.to_code() writes it)
    est_peak_bytes: int
    compute_seconds: float
    comm_seconds: tuple[tuple[str, float], ...]
    step_seconds: float
    fits: bool
    pipeline_stages: int = 1  # PP: spec.pipeline_parallel (its micro-batches: spec.microbatches)
    bubble_seconds: float = 0.0  # PP: the schedule's idle slots (in compute_seconds)
    checked_peak_bytes: int | None = None  # shallow measurement at its own micro-batch, extrapolated

    @property
    def label(self) -> str:
        parts = [self.spec.describe()]
        parts.append(f"checkpoint {self.regions} blocks" if self.regions else "no checkpointing")
        if self.precision:
            parts.append(self.precision)
        if self.pipeline_stages > 1:
            parts.append(f"micro-batch {self.micro_batch} x {self.spec.microbatches} in the schedule")
        else:
            parts.append(
                f"micro-batch {self.micro_batch}" + (f" x {self.accumulation}" if self.accumulation > 1 else "")
            )
        return ", ".join(parts)


@dataclass
class LayoutResult:
    gpus: int
    device: Device
    fabric: Fabric
    target: Target
    global_batch: int
    candidates: list[LayoutCandidate]  # fastest first
    front: list[LayoutCandidate]  # the Pareto front of those that fit (estimated peak vs time), lowest peak first
    chosen: LayoutCandidate | None
    remeasured: "ParallelMeasurement | None"
    pruned: list[str]  # layouts dropped by the lower bound, in words
    notes: list[str]
    cpu_seconds: float  # everything, the full-depth re-measurement included (time.process_time)
    measurements: int  # per-rank shallow measurements
    search_cpu_seconds: float = 0.0  # the search alone
    remeasure_cpu_seconds: float = 0.0  # the chosen layout measured per rank at full depth

    @property
    def fitting(self) -> list[LayoutCandidate]:
        return [c for c in self.candidates if c.fits]

    def front_table(self) -> str:
        if not self.front:
            return "  (no layout fits)"
        rows = [("est. peak/GPU", "est. step", "fits", "layout")]
        for c in self.front:
            rows.append((format_bytes(c.est_peak_bytes), _seconds(c.step_seconds), "yes" if c.fits else "no", c.label))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  " + "  ".join(r[i].rjust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)

    def summary(self) -> str:
        lines = [
            f"layout planner: {self.gpus} x {self.device.name}, target {self.target.label} "
            f"(estimates under {format_bytes(self.target.usable_bytes)}: the 80% rule, as the search's peaks are "
            f"extrapolated, not replayed), global batch {self.global_batch}; "
            f"{len(self.candidates)} candidates, {len(self.fitting)} fit; {self.measurements} per-rank measurements; "
            f"{self.search_cpu_seconds:.1f} s CPU searching, {self.remeasure_cpu_seconds:.1f} s re-measuring"
        ]
        if self.chosen is None and self.fitting:  # the estimates said yes, the checks said no
            lines.append(
                "no layout chosen: the fastest estimated to fit measured over the target at their "
                "micro-batch (notes below); the front lists estimates, not checked layouts"
            )
        elif self.chosen is None:
            lines.append("no layout fits")
        else:
            c = self.chosen
            comm = ", ".join(f"{k} {_seconds(v)}" for k, v in c.comm_seconds if v) or "none"
            bubble = f", of which the pipeline's bubble {_seconds(c.bubble_seconds)}" if c.pipeline_stages > 1 else ""
            lines.append(
                f"chosen: {c.label}: estimated step {_seconds(c.step_seconds)} (compute {_seconds(c.compute_seconds)}{bubble}; "
                f"communication {comm}), peak {format_bytes(c.est_peak_bytes)} estimated"
            )
            if self.remeasured is not None:
                lines.append(self._remeasured_line())
        lines += [f"pruned by the lower bound: {p}" for p in self.pruned]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _remeasured_line(self) -> str:
        """The chosen layout measured per rank at full depth: the allocator replay's verdict where its
        ranks were replayed (predicted reserved + CUDA context + buffers), else the 80% rule's, labelled."""
        from memsave_nb.parallel.verdict import worst_fit

        m = self.remeasured
        assert m is not None
        peak = m.device_peak_bytes
        rank, fit = worst_fit(self.target, m, fixes=False)
        if fit.replay is None:
            return (
                f"re-measured per rank at full depth: worst rank {format_bytes(peak)} ({self.target.verdict(peak)}; "
                "80% rule, no allocator replay)"
            )
        return (
            f"re-measured per rank at full depth: worst rank {format_bytes(peak)} counted; rank {rank.rank} predicted "
            f"reserved {format_bytes(fit.replay.reserved_bytes)}: {fit.verdict(self.target)}"
        )

    def to_code(self) -> str:
        if self.chosen is None:
            raise PlanError("no layout fits: nothing to write as code")
        return self.chosen.plan.to_code()


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"
