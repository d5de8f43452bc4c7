"""When nothing fits: which knob would, and the figure it reaches.

"30 plans, 0 fit" left the user where they started although batch 16 fit at 28%. Each knob here is
tried on its own, from the plan the user holds, with one measurement (or a short bisection) in
the search's mode: a smaller batch (the largest that fits), micro-batches (gradient
accumulation), a lower precision, the chunked cross-entropy (causal LMs: no full logits), freezing
all but the last block, every block checkpointed or offloaded, and more GPUs (FSDP2, measured per
rank). Every figure is a measured peak, never a
guess, and "fits" is ``target.fit_of`` (the report's verdict: the allocator replay where there is
one, the 80% rule otherwise); a knob that cannot apply to this workload is left out. The UI's "Fit a GPU" tab shows them
when a search finds nothing; the CLI can print ``hint_lines(hints)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from memsave_nb.errors import Cancelled, MemsaveError
from memsave_nb.target import RULE_80, Fit, Target, fit_of, max_batch, measure_peak

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.measure.result import Measurement
    from memsave_nb.plan import Plan
    from memsave_nb.workload import Workload

__all__ = ["KnobHint", "what_would_fit", "hint_lines"]

LOW_PRECISIONS = ("bf16", "bf16_master", "autocast_bf16")
GPU_COUNTS = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class KnobHint:
    """One knob turned on its own: what was changed and the peak it reached."""

    knob: str  # "smaller batch", "micro-batches", "precision", "loss", "freezing", "checkpointing", "offload", "more GPUs"
    change: str  # e.g. "batch 16", "4 micro-batches of 4", "bf16", "FSDP2 on 8 GPUs"
    peak_bytes: int
    fits: bool
    plan: "Plan | None" = None  # the plan that reaches it (None for more GPUs: a parallel spec)
    # the verdict in words, from ``target.fit_of`` (the report's own test), saying which rule decided
    verdict: str = ""

    def line(self, target: Target) -> str:
        from memsave_nb.units import format_bytes

        said = self.verdict or target.verdict(self.peak_bytes)
        return f"{self.knob}: {self.change} -> peak {format_bytes(self.peak_bytes)}, {said}"


def hint_lines(hints: Sequence[KnobHint], target: Target) -> list[str]:
    """The hints as text lines, those that fit first (what a CLI prints under "no candidate fits")."""
    if not hints:
        return ["no single knob tried here reaches the target"]
    ordered = sorted(hints, key=lambda h: h.peak_bytes)
    fit, rest = [h for h in ordered if h.fits], [h for h in ordered if not h.fits]
    if not fit:
        return ["no single knob fits; the closest:"] + [f"  {h.line(target)}" for h in rest]
    # a knob that does not fit is never listed under "fit" (issue 42): its own heading
    lines = ["knobs that fit on their own:"] + [f"  {h.line(target)}" for h in fit]
    if rest:
        lines += ["knobs that do not fit on their own (closest first):"] + [f"  {h.line(target)}" for h in rest]
    return lines


def what_would_fit(
    workload: "Workload",
    plan: "Plan",
    target: Target,
    *,
    mode: str = "fake",
    gpus: bool = True,
    cancel_event: threading.Event | None = None,
) -> list[KnobHint]:
    """Each knob on its own from ``plan``, with the peak it reaches (see the module doc), in the
    order above. ``gpus=False`` skips the per-rank FSDP2 probes (the slowest)."""
    from memsave_nb.checkpointing import suggest_regions
    from memsave_nb.knobs import batch_size_of
    from memsave_nb.target import _raw_batch

    def peak(p: "Plan") -> "Measurement | None":
        try:
            return measure_peak(workload, p, mode, cancel_event=cancel_event)
        except Cancelled:
            raise
        except MemsaveError:  # this knob does not apply here (e.g. a batch function)
            return None

    hints: list[KnobHint] = []

    def add(knob: str, change: str, p: "Plan", m: "Measurement | None") -> None:
        if m is not None:
            fit = fit_of(target, m)  # with the allocator setting that would fit, where one does
            hints.append(KnobHint(knob, change, m.peak_bytes, fit.fits, p, fit.verdict(target)))

    try:
        batch = plan.batch_size or batch_size_of(_raw_batch(workload))
    except MemsaveError:
        batch = None
    if batch and batch > 1:
        r = max_batch(workload, plan, target, mode=mode, upper=batch - 1, cancel_event=cancel_event)
        smallest = min((pk, v) for v, pk in r.probes if pk is not None) if any(pk for _, pk in r.probes) else None
        if r.value >= 1:  # the search judged each probe with fit_of: its answer is the verdict's
            hints.append(
                KnobHint(
                    "smaller batch",
                    f"batch {r.value} (from {batch})",
                    r.peak_bytes or 0,
                    True,
                    plan.replace(batch_size=r.value),
                    f"fits ({r.rule})",
                )
            )
        elif smallest is not None:
            hints.append(
                KnobHint(
                    "smaller batch",
                    f"batch {smallest[1]} (from {batch})",
                    smallest[0],
                    False,
                    plan.replace(batch_size=smallest[1]),
                    f"does not fit ({r.rule})",
                )
            )
        _micro_batches(plan, batch, peak, add, target)
    for precision in LOW_PRECISIONS:
        if plan.precision != precision:
            p = plan.replace(precision=precision)
            add("precision", precision, p, peak(p))
    if plan.loss != "chunked":  # left out where it does not apply (not a causal LM, a loss function of its own)
        from memsave_nb.loss import DEFAULT_LOSS_CHUNK

        p = plan.replace(loss="chunked", loss_chunk=None)
        add("loss", f"chunked cross-entropy ({DEFAULT_LOSS_CHUNK} tokens per chunk)", p, peak(p))
    _freezing(workload, plan, peak, add)
    regions = suggest_regions(workload.model)
    if regions:
        for knob, kind in (("checkpointing", "full"), ("offload", "offload")):
            p = plan.replace(regions={r: kind for r in regions})
            add(
                knob,
                f"every block ({len(regions)}) {'checkpointed' if kind == 'full' else 'offloaded to the host'}",
                p,
                peak(p),
            )
    if gpus:
        _more_gpus(workload, plan, target, hints, cancel_event)
    return hints


def _micro_batches(plan: "Plan", batch: int, peak: Callable, add: Callable, target: Target) -> None:
    """The fewest micro-batches (a divisor of the batch) that fit; else the finest split's figure."""
    ks = [k for k in (2, 4, 8, 16, 32, 64) if k < batch and batch % k == 0] + [batch]
    last = None
    for k in ks:
        p = plan.replace(batch_size=batch // k, accumulation_steps=k)
        m = peak(p)
        if m is None:
            return
        last = (k, p, m)
        if fit_of(target, m, fixes=False).fits:
            break
    if last is not None:
        k, p, m = last
        add("micro-batches", f"{k} micro-batches of {batch // k}", p, m)


def _freezing(workload: "Workload", plan: "Plan", peak: Callable, add: Callable) -> None:
    from memsave_nb.checkpointing import PlanError
    from memsave_nb.presets import last_blocks

    if plan.frozen or plan.trainable:
        return  # the user froze already: their choice
    try:
        frozen = last_blocks(workload.model, 1)
    except PlanError:
        return
    p = plan.replace(frozen=frozen.frozen, trainable=frozen.trainable)
    add("freezing", "train only the last block", p, peak(p))


def _more_gpus(
    workload: "Workload", plan: "Plan", target: Target, hints: list[KnobHint], cancel_event: threading.Event | None
) -> None:
    """The fewest GPUs (FSDP2, one block per group) whose worst rank fits, measured per rank; the
    largest count's figure when none does."""
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    last = None
    for n in GPU_COUNTS:
        if cancel_event is not None and cancel_event.is_set():
            raise Cancelled("cancelled")
        try:
            value = measure_parallel(workload, ParallelSpec(world_size=n), plan).device_peak_bytes
        except MemsaveError:
            return
        fit = Fit(target.fits(value), RULE_80, value)  # per-rank sizing has no allocator replay
        last = KnobHint("more GPUs", f"FSDP2 on {n} GPUs (worst rank)", value, fit.fits, verdict=fit.verdict(target))
        if last.fits:
            break
    if last is not None:
        hints.append(last)
