"""The planner: given a target GPU, the plans that fit, ranked by estimated step time.

How it searches (see docs/planner.md for the why):

1. *Global configurations* G = freezing choice x precision x memory-saving layers. Each is
   measured once (one step in fake or real mode) and costed once (:func:`step_cost`).
2. *Region choices* (none / full / save_matmuls / offload per checkpointable block) are measured
   once for all regions together, at the first G: a region's saved bytes under each kind, as a
   share of its saved bytes with no checkpointing. Regions are independent to first order, so a
   candidate's peak is G's peak minus the sum of its regions' reductions, plus the excess that
   recomputed or reloaded regions bring back in backward: the largest region reduction times a
   factor per kind, measured in the same pass (the peak with every region of that kind, above
   G's peak minus the reductions, over the largest region's reduction). Its time is G's time plus
   each region's recompute time (its forward ops, or its non-matmul ops for save_matmuls) or
   transfer time (offload: bytes out and back over the link, not overlapped).
3. *Micro-batching*: k micro-batches of B/k with gradient accumulation scale the batch-dependent
   part of the peak by 1/k, add the accumulated gradients, and re-read the weights k times.
4. Assignments per G: for each kind, the first n regions (n = 0..R); for each pair of kinds, the
   first n regions one way and the rest the other; and a greedy sequence that
   adds the (region, kind) with the fewest added seconds per byte saved until every region is
   taken. Every (G, assignment, k) is a candidate.
5. Compile budgets (real mode only): each measured directly; its time is the first
   configuration's estimate times the measured compiled / eager step-time ratio.
6. The Pareto front (estimated peak vs estimated time); the fastest candidates that fit are
   re-measured with a full step, in order, until one fits for real: that is the chosen plan.
   "Fits" on an estimate is ``target.estimate_fits`` (under the GPU less the CUDA context, the
   line the replay faces); on a re-measured step it is ``target.fit_of``, the report's verdict.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from memsave_nb.checkpointing import PlanError, show, suggest_regions
from memsave_nb.knobs import MAX_KNOB
from memsave_nb.errors import Cancelled, MemsaveError
from memsave_nb.offload import LINKS
from memsave_nb.plan import Plan
from memsave_nb.planner.cost import StepCost, step_cost
from memsave_nb.planner.pareto import pareto_front
from memsave_nb.planner.roofline import Device, device_named
from memsave_nb.target import Target, check_search_args, estimate_fits, fit_of, measure_peak, replay_line_bytes
from memsave_nb.vocabulary import SEARCHED_REGION_KINDS

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.measure.result import Measurement
    from memsave_nb.workload import Workload

__all__ = ["Candidate", "PlannerResult", "plan_for", "REGION_KINDS"]

REGION_KINDS = SEARCHED_REGION_KINDS


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    config: str  # the global configuration's label
    est_peak_bytes: int
    est_seconds: float
    fits: bool
    measured_peak_bytes: int | None = None
    measured_seconds: float | None = None
    measured_verdict: str = ""  # target.fit_of on the re-measured step (which rule decided, in words)

    @property
    def label(self) -> str:
        """The plan in words, with which region takes which kind: two candidates that differ only
        in where the kinds go (mirror images) read differently."""
        if self.plan.name:
            return self.plan.name
        regions = self.plan.active_regions
        if not regions:
            return self.plan.describe()
        rest = self.plan.replace(regions={})
        where = "; ".join(f"{kind} {_compact(names)}" for kind, names in _by_kind(regions).items())
        return where if rest.is_empty else f"{where}; {rest.describe()}"


def _by_kind(regions: Mapping[str, Any]) -> dict[str, list[str]]:
    """Region names per kind ("full", "save_matmuls", "offload", ...), kinds in order of first use."""
    from memsave_nb.checkpointing import POLICY_PRESETS

    out: dict[str, list[str]] = {}
    for name, policy in regions.items():
        kind = next((k for k, preset in POLICY_PRESETS.items() if preset == policy), "selective")
        out.setdefault(kind, []).append(name)
    return out


def _compact(names: list[str]) -> str:
    """``a.0, a.1, a.2, a.5`` as ``a.0-2, a.5``: runs of numbered siblings written as ranges."""
    runs: list[tuple[str, int, int]] = []
    others: list[str] = []
    for name in names:
        head, _, tail = name.rpartition(".")
        if tail.isdigit() and runs and runs[-1][0] == head and runs[-1][2] == int(tail) - 1:
            runs[-1] = (head, runs[-1][1], int(tail))
        elif tail.isdigit():
            runs.append((head, int(tail), int(tail)))
        else:
            runs.append((name, -1, -1))
    for head, a, b in runs:
        if a < 0:
            others.append(head)
        else:
            prefix = f"{head}." if head else ""
            others.append(f"{prefix}{a}" if a == b else f"{prefix}{a}-{b}")
    return ", ".join(others)


@dataclass
class PlannerResult:
    target: Target
    device: Device
    candidates: list[Candidate]  # fastest first
    front: list[Candidate]  # Pareto front, lowest peak first
    chosen: Candidate | None
    remeasured: list[Candidate]
    seconds: float
    measurements: int  # full steps measured
    notes: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    def summary(self) -> str:
        from memsave_nb.units import format_bytes

        lines = [
            f"planner: {len(self.candidates)} candidate plans, {len(self.fitting)} fit {self.target.label} "
            f"(estimates under {format_bytes(replay_line_bytes(self.target))}, the GPU less the CUDA context; "
            f"re-measured steps by the allocator replay); {self.measurements} steps measured in {self.seconds:.1f} s; "
            f"time on {self.device.name}",
        ]
        if self.chosen is None:
            lines.append("no candidate fits")
        else:
            c = self.chosen
            lines.append(
                f"chosen: {c.label}: estimated {c.est_seconds * 1e3:.1f} ms, peak {format_bytes(c.est_peak_bytes)} estimated, "
                f"{format_bytes(c.measured_peak_bytes or 0)} re-measured "
                f"({c.measured_verdict or self.target.verdict(c.measured_peak_bytes or 0)})"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class _Config:
    label: str
    plan: Plan
    measurement: "Measurement"
    cost: StepCost


def _merge(base: Plan, freezing: Plan, **knobs: Any) -> Plan:
    return base.replace(
        frozen=freezing.frozen or base.frozen,
        trainable=freezing.trainable or base.trainable,
        input_requires_grad=freezing.input_requires_grad
        if freezing.input_requires_grad is not None
        else base.input_requires_grad,
        bn_eval=freezing.bn_eval or base.bn_eval,
        **knobs,
    )


def _has_field(workload: "Workload", name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(workload))


def plan_for(
    workload: "Workload",
    target: Target,
    *,
    mode: str = "fake",
    device: str | Device = "H100",
    freezing: Mapping[str, Plan] | None = None,
    precisions: Sequence[str | None] = (None,),
    memsave: Sequence[bool] = (False,),
    micro_batches: Sequence[int] = (1,),
    region_kinds: Sequence[str] = REGION_KINDS,
    regions: Sequence[str] | None = None,
    link: str = "pcie5",
    base_plan: Plan | None = None,
    remeasure: int = 3,
    compile_budgets: Sequence[float] = (),
    cancel_event: threading.Event | None = None,
) -> PlannerResult:
    """Search plans for ``workload`` under ``target`` (see the module doc). ``freezing`` maps
    labels to plans whose freezing is tried (default: the model's own); ``precisions`` and
    ``memsave`` list the global choices to try; ``micro_batches`` the k's (each must divide the
    batch size; k > 1 needs the engine's gradient accumulation). ``cancel_event``, set from another
    thread, stops the search at the next measurement with ``Cancelled`` (the model restored)."""
    start = time.perf_counter()
    base_plan = Plan() if base_plan is None else base_plan
    check_search_args(base_plan, target, mode, plan_name="base_plan")
    dev = device_named(device)
    _check_choices(link, micro_batches, region_kinds, precisions, memsave, remeasure, compile_budgets)
    model = workload.model
    regions = _check_regions(model, regions) if regions is not None else suggest_regions(model)
    freezing = _check_freezing(freezing) if freezing else {"as given": Plan()}
    notes: list[str] = []
    measurements = 0

    from memsave_nb.knobs import batch_size_of
    from memsave_nb.target import _raw_batch

    batch = base_plan.batch_size or batch_size_of(_raw_batch(workload))
    ks = []
    for k in micro_batches:
        if k == 1:
            ks.append(1)
        elif batch % k:
            notes.append(f"micro-batches {k}: does not divide the batch {batch}")
        elif not _has_field(workload, "accumulation_steps"):
            notes.append(f"micro-batches {k}: this engine has no gradient accumulation (Workload.accumulation_steps)")
        else:
            ks.append(k)

    # 1. global configurations
    configs: list[_Config] = []
    for f_label, f_plan in freezing.items():
        for precision in precisions:
            for swap in memsave:
                knobs: dict[str, Any] = {"precision": precision}
                if swap:
                    knobs["memsave"] = ("*",)
                plan = _merge(base_plan, f_plan, **knobs)
                label = ", ".join([f_label, precision or "as given"] + (["memsave"] if swap else []))
                try:
                    m = measure_peak(workload, plan, mode, cancel_event=cancel_event)
                    measurements += 1
                    cost = step_cost(workload, plan, regions, dev)
                except Cancelled:
                    raise
                except MemsaveError as exc:
                    notes.append(f"{label}: skipped ({' '.join(str(exc).split())[:160]})")
                    continue
                configs.append(_Config(label, plan, m, cost))
    if not configs:
        raise PlanError("the planner found no configuration that runs; see the notes of a single measurement")
    # a measurement's caveat that holds for every candidate (e.g. the optimizer ran the CPU's
    # single-tensor step where a GPU runs foreach) goes into the planner's notes, once
    for note in dict.fromkeys(n for c in configs for n in c.measurement.notes if "single-tensor step" in n):
        notes.append(note)

    # 2. region kinds, measured once at the first configuration
    ratio: dict[str, dict[str, float]] = {r: {"none": 1.0} for r in regions}
    transient: dict[str, float] = {}  # measured peak above "G0's peak minus the reductions", per kind
    g0 = configs[0]
    for kind in region_kinds:
        plan = g0.plan.replace(regions={r: kind for r in regions})
        try:
            m = measure_peak(workload, plan, mode, cancel_event=cancel_event)
            measurements += 1
        except Cancelled:
            raise
        except MemsaveError as exc:
            notes.append(f"region kind {kind}: skipped ({' '.join(str(exc).split())[:160]})")
            continue
        reductions = []
        for r in regions:
            s0 = g0.measurement.module(r).saved_bytes
            ratio[r][kind] = (m.module(r).saved_bytes / s0) if s0 else 1.0
            reductions.append(s0 - m.module(r).saved_bytes)
        excess = max(0.0, m.peak_bytes - (g0.measurement.peak_bytes - sum(reductions)))
        transient[kind] = excess / max(1, max(reductions, default=0))
    kinds = [k for k in region_kinds if any(k in ratio[r] for r in regions)]

    # 3.-4. candidates
    candidates: list[Candidate] = []
    for cfg in configs:
        saved = {r: cfg.measurement.module(r).saved_bytes for r in regions}
        options = {
            (r, k): (
                saved[r] * (1.0 - ratio[r][k]),
                cfg.cost.recompute_seconds(r, k) if k != "offload" else 2 * saved[r] / LINKS[link].bytes_per_second,
            )
            for r in regions
            for k in kinds
            if k in ratio[r]
        }
        for assignment in _assignments(regions, kinds, options):
            for k in ks:
                candidates.append(_estimate(cfg, assignment, options, transient, k, batch, target, dev))

    # compile budgets (real mode only): measured directly, time scaled from the first config's estimate
    if compile_budgets:
        if mode != "real":
            notes.append("compile budgets: real mode only (fake tensors do not compile); skipped")
        else:
            compiled, n = _compiled_candidates(workload, g0, compile_budgets, target, cancel_event)
            candidates += compiled
            measurements += n

    # dedupe (the same plan from two routes), fastest first
    unique: dict[str, Candidate] = {}
    for c in candidates:
        key = c.plan.to_json()
        if key not in unique or c.est_seconds < unique[key].est_seconds:
            unique[key] = c
    ranked = sorted(unique.values(), key=lambda c: (c.est_seconds, c.est_peak_bytes))

    # 5. re-measure the fastest that fit
    remeasured: list[Candidate] = []
    chosen = None
    for c in [c for c in ranked if c.fits][: max(0, remeasure)]:
        try:
            m = measure_peak(workload, c.plan, mode, cancel_event=cancel_event)
            measurements += 1
        except Cancelled:
            raise
        except MemsaveError as exc:
            notes.append(f"re-measuring {c.label}: {' '.join(str(exc).split())[:160]}")
            continue
        fit = fit_of(target, m, fixes=False)  # the report's verdict on the re-measured step
        c2 = dataclasses.replace(
            c, measured_peak_bytes=m.peak_bytes, measured_verdict=fit.verdict(target), fits=fit.fits
        )
        remeasured.append(c2)
        if fit.fits:
            chosen = c2
            break
    front = pareto_front(ranked, key=lambda c: (c.est_peak_bytes, c.est_seconds))
    return PlannerResult(
        target, dev, ranked, front, chosen, remeasured, time.perf_counter() - start, measurements, notes
    )


def _sequence(value: Any, name: str) -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise PlanError(f"{name} must be a list or tuple, got {show(value)}")
    return list(value)


def _check_choices(
    link: Any,
    micro_batches: Any,
    region_kinds: Any,
    precisions: Any,
    memsave: Any,
    remeasure: Any,
    compile_budgets: Any,
) -> None:
    """Every list the planner takes, checked in one line each before any measurement."""
    if not isinstance(link, str) or link not in LINKS:
        raise PlanError(f"link {show(link)}: choose one of {sorted(LINKS)}")
    for k in _sequence(micro_batches, "micro_batches"):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_KNOB:
            raise PlanError(f"micro_batches must hold whole numbers in [1, {MAX_KNOB}], got {show(k)}")
    for kind in _sequence(region_kinds, "region_kinds"):
        if not isinstance(kind, str) or kind not in REGION_KINDS:
            raise PlanError(f"region kind {show(kind)}: choose from {REGION_KINDS}")
    for precision in _sequence(precisions, "precisions"):
        if precision is not None:
            Plan(precision=precision)  # one-line PlanError naming the precision
    for swap in _sequence(memsave, "memsave"):
        if not isinstance(swap, bool):
            raise PlanError(f"memsave must hold True or False, got {show(swap)}")
    if isinstance(remeasure, bool) or not isinstance(remeasure, int) or remeasure < 0:
        raise PlanError(f"remeasure must be a whole number >= 0, got {show(remeasure)}")
    for budget in _sequence(compile_budgets, "compile_budgets"):
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise PlanError(f"compile budget must be a number in [0, 1], got {show(budget)}")


def _check_regions(model: Any, regions: Any) -> list[str]:
    names = _sequence(regions, "regions")
    known = dict(model.named_modules())
    for name in names:
        if not isinstance(name, str) or not name or name not in known:
            raise PlanError(f"regions: {show(name)} is not a submodule of the model")
    return names


def _check_freezing(freezing: Any) -> dict[str, Plan]:
    if not isinstance(freezing, Mapping):
        raise PlanError(f"freezing must map labels to plans, got {show(freezing)}")
    for label, plan in freezing.items():
        if not isinstance(plan, Plan):
            raise PlanError(f"freezing[{show(label)}] must be a Plan, got {show(plan)}")
    return {str(label): plan for label, plan in freezing.items()}


def _assignments(
    regions: list[str], kinds: list[str], options: dict[tuple[str, str], tuple[float, float]]
) -> Iterable[dict[str, str]]:
    yield {}
    for kind in kinds:
        for n in range(1, len(regions) + 1):
            yield {r: kind for r in regions[:n]}
    # two kinds: the first n regions one way, the rest another (e.g. recompute early, offload late)
    for a in kinds:
        for b in kinds:
            if a != b:
                for n in range(1, len(regions)):
                    yield {r: (a if i < n else b) for i, r in enumerate(regions)}
    # greedy: cheapest seconds per byte saved first; a region takes at most one kind
    order = sorted(
        ((r, k) for (r, k), (b, s) in options.items() if b > 0),
        key=lambda rk: options[rk][1] / options[rk][0],
    )
    current: dict[str, str] = {}
    for r, k in order:
        if r in current:
            continue
        current[r] = k
        yield dict(current)


def _estimate(
    cfg: _Config,
    assignment: dict[str, str],
    options,
    transient: dict[str, float],
    k: int,
    batch: int,
    target: Target,
    dev: Device,
) -> Candidate:
    m = cfg.measurement
    reductions = [options[(r, kind)][0] for r, kind in assignment.items()]
    added = sum(options[(r, kind)][1] for r, kind in assignment.items())
    # a recomputed / reloaded region comes back in backward: its reduction times the factor
    # measured once per kind (all regions of that kind, at the first configuration)
    excess = max((transient.get(kind, 0.0) * options[(r, kind)][0] for r, kind in assignment.items()), default=0.0)
    peak = m.peak_bytes - sum(reductions) + excess
    seconds = cfg.cost.total_seconds + added
    plan = cfg.plan.replace(regions=dict(assignment))
    if k > 1:
        split = m.peak_split
        fixed = split.parameters + split.optimizer_state + split.gradients
        grads = _grad_bytes(m)  # all gradients, held across micro-batches
        peak = fixed + (peak - fixed) / k + max(0, grads - split.gradients)
        fb_launch = (cfg.cost.ops.get("forward", 0) + cfg.cost.ops.get("backward", 0)) * dev.launch_seconds
        seconds += (k - 1) * (2 * cfg.cost.weight_bytes / dev.bytes_per_second + fb_launch)
        plan = plan.replace(batch_size=batch // k, accumulation_steps=k)
    # reductions summed from per-region shares can exceed what is left to take (seen: -480.8 MiB on
    # a tiny LoRA Llama); no plan frees the weights, their gradients or the optimizer's state
    peak = max(peak, _resident_bytes(m))
    return Candidate(plan, cfg.label, int(peak), seconds, estimate_fits(target, peak))


def _resident_bytes(m: "Measurement") -> int:
    """Parameters + gradients + optimizer state at the moment they sum highest: what lives
    whatever the regions do, so no estimate goes below it."""
    split = m.peak_split
    at_peak = split.parameters + split.gradients + split.optimizer_state
    if not len(m.timeline):
        return at_peak
    cats = m.timeline.by_category
    return max(at_peak, max(map(sum, zip(cats["parameters"], cats["gradients"], cats["optimizer_state"]))))


def _grad_bytes(m: "Measurement") -> int:
    return max(m.timeline.by_category["gradients"]) if len(m.timeline) else 0


def _compiled_candidates(
    workload: "Workload",
    g0: _Config,
    budgets: Sequence[float],
    target: Target,
    cancel_event: threading.Event | None = None,
) -> tuple[list[Candidate], int]:
    """One real measurement per budget (and one eager, timed): the peak is measured, the time is
    the first configuration's estimate times the measured compiled / eager step-time ratio."""
    from memsave_nb.measure import measure
    from memsave_nb.measure.engine import model_lock

    with model_lock(workload.model), g0.plan.apply(workload) as wl:
        eager = measure(wl, mode="real", repeats=3, cancel_event=cancel_event)
    out = []
    for b in budgets:
        plan = g0.plan.replace(compile_budget=b)
        with model_lock(workload.model), plan.apply(workload) as wl:
            m = measure(wl, mode="real", repeats=3, cancel_event=cancel_event)
        ratio = (m.step_seconds or 0.0) / (eager.step_seconds or 1.0)
        fit = fit_of(target, m, fixes=False)  # the compiled route has no replay: the 80% rule, said so
        out.append(
            Candidate(
                plan,
                f"{g0.label}, compile {b:g}",
                m.peak_bytes,
                g0.cost.total_seconds * ratio,
                fit.fits,
                measured_peak_bytes=m.peak_bytes,
                measured_seconds=m.step_seconds,
                measured_verdict=fit.verdict(target),
            )
        )
    return out, 1 + len(budgets)
