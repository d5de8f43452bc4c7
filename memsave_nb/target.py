"""The target GPU: "my GPU has N GB". Fits / does not fit, and the largest batch or sequence
that fits, found by bisection over fake-mode measurements.

Sizes: a GPU sold as "N GB" is read as N GiB (2**30 bytes), as the vendors' capacities are
(an RTX 4090's 24 GB is 24 GiB, an H100's 80 GB is 80 GiB).

Headroom: a plan *fits* when its measured peak is at most ``headroom`` (default 0.8) of the
target. The tracker counts tensors; the GPU also holds what no dispatch-level counter sees: the
CUDA context and kernels (about 300-500 MB per GPU), the caching allocator's fragmentation
(blocks reserved but not usable for the next request), cuBLAS/cuDNN workspaces and, with more
than one GPU, communication-library buffers (about 0.5 GB per communicator). Fujii et al.
("Accelerating Large Language Model Training with 4D Parallelism and Memory Consumption
Estimator", arXiv:2411.06465; 454 runs on A100 and H100) found that runs whose estimated memory
was below 80% of the GPU's never ran out of memory: the 80% rule.

Where the step's allocations were replayed through the caching-allocator model
(``measure/cuda_allocator.py``), ``reserved_verdict`` replaces the rule: predicted reserved memory
+ CUDA context + communication buffers against the whole GPU (docs/allocator.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.errors import Cancelled

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.measure.result import Measurement
    from memsave_nb.plan import Plan
    from memsave_nb.workload import Workload

__all__ = [
    "PRESETS_GB",
    "DEFAULT_HEADROOM",
    "HEADROOM_SOURCE",
    "HEADROOM_WHY",
    "Target",
    "SearchResult",
    "check_search_args",
    "measure_peak",
    "plausible_preset_gb",
    "max_batch",
    "max_seq_len",
    "ReservedVerdict",
    "reserved_verdict",
    "Fit",
    "fit_of",
    "RULE_REPLAY",
    "RULE_80",
    "replay_line_bytes",
    "estimate_fits",
]

GIB = 2**30
PRESETS_GB: tuple[float, ...] = (16, 24, 40, 48, 80, 141)
DEFAULT_HEADROOM = 0.8
HEADROOM_SOURCE = "Fujii et al., arXiv:2411.06465 (454 runs on A100/H100: estimates under 80% never ran out of memory)"
HEADROOM_WHY = (
    "the GPU also holds what tensors do not show: the CUDA context (~300-500 MB), allocator "
    "fragmentation, library workspaces and communication buffers (~0.5 GB per communicator)"
)


# the largest target a plan is sized for (1 PiB): beyond it byte counts stop being exact integers
MAX_GB = float(2**20)
# the largest batch size or sequence length a search probes (the knobs' own bound)
MAX_UPPER = 2**31 - 1


def _number_in(value: Any, low: float, high: float) -> bool:
    """``value`` is a real number (not a bool) with ``low <= value <= high`` (NaN and inf are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return low <= float(value) <= high
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class Target:
    """A GPU memory size and the share of it a plan may use."""

    gb: float
    headroom: float = DEFAULT_HEADROOM
    name: str = ""

    def __post_init__(self) -> None:
        if not _number_in(self.gb, 0, MAX_GB) or self.gb == 0:
            raise PlanError(f"target memory must be a positive number of GB up to {MAX_GB:g}, got {show(self.gb)}")
        if not _number_in(self.headroom, 0, 1) or self.headroom == 0:
            raise PlanError(f"headroom must be a fraction in (0, 1], got {show(self.headroom)}")
        object.__setattr__(self, "gb", float(self.gb))
        object.__setattr__(self, "headroom", float(self.headroom))
        if self.usable_bytes < 1:
            raise PlanError(f"target {self.gb:g} GB x headroom {self.headroom:g} leaves no byte to plan with")

    @property
    def total_bytes(self) -> int:
        return int(self.gb * GIB)

    @property
    def usable_bytes(self) -> int:
        """The headroom line: what a plan's measured peak may reach."""
        return int(self.gb * GIB * self.headroom)

    @property
    def label(self) -> str:
        return self.name or f"{self.gb:g} GB"

    def fits(self, peak_bytes: int | float) -> bool:
        return peak_bytes <= self.usable_bytes

    def verdict(self, peak_bytes: int | float) -> str:
        """``"fits"`` or ``"does not fit"`` with the share of the headroom line used."""
        share = peak_bytes / self.usable_bytes
        word = "fits" if self.fits(peak_bytes) else "does not fit"
        return f"{word} ({share:.0%} of {self.headroom:.0%} x {self.label})"

    def line(self) -> str:
        from memsave_nb.units import format_bytes  # formatting only, no widgets

        return (
            f"target {self.label}: plans must stay under {format_bytes(self.usable_bytes)} "
            f"({self.headroom:.0%} headroom line; {HEADROOM_WHY}; {HEADROOM_SOURCE})"
        )


def plausible_preset_gb(measurement: "Measurement", headroom: float = DEFAULT_HEADROOM) -> float | None:
    """The smallest preset GPU the step could plausibly fit: the smallest whose headroom line holds
    the measured peak, else the smallest that holds what no checkpointing or micro-batching removes
    (parameters, gradients and optimizer state at the peak); None when no preset holds even that
    (a 70B full fine-tune: shard it over GPUs, or freeze most of it, before picking a card)."""
    split = measurement.peak_split
    floor = split.parameters + split.gradients + split.optimizer_state
    for need in (measurement.peak_bytes, floor):
        fitting = [gb for gb in PRESETS_GB if need <= gb * GIB * headroom]
        if fitting:
            return float(min(fitting))
    return None


@dataclass(frozen=True)
class SearchResult:
    """The largest value that fits (0 when even the smallest does not), and every probe."""

    knob: str
    value: int
    peak_bytes: int | None  # at ``value``
    probes: tuple[tuple[int, int | None], ...] = field(default=())  # (value, peak or None when the step failed)
    limit: str = ""  # why the search stopped where it did, besides memory
    # caveats the probes' measurements carried (once each): e.g. fake mode ran the optimizer's
    # single-tensor step where a GPU runs foreach, so the boundary may sit lower on that GPU
    notes: tuple[str, ...] = field(default=())
    # which test decided "fits" (``fit_of``): "allocator replay", "80% rule", or both joined
    rule: str = ""

    @property
    def count(self) -> int:
        return len(self.probes)


_NOT_GIVEN = object()


def check_search_args(
    plan: Any, target: Any = _NOT_GIVEN, mode: Any = "fake", upper: Any = None, *, plan_name: str = "plan"
) -> None:
    """Name a bad argument of a search (max batch, max sequence, the planner) in one line, before
    any measurement: a wrong mode must not read as "even 1 does not fit"."""
    from memsave_nb.measure.engine import MODES
    from memsave_nb.plan import Plan

    if not isinstance(plan, Plan):
        raise PlanError(f"{plan_name} must be a Plan, got {show(plan)}")
    if target is not _NOT_GIVEN and not isinstance(target, Target):
        raise PlanError(f"target must be a Target (e.g. Target(80)), got {show(target)}")
    if not isinstance(mode, str) or mode not in MODES:
        raise PlanError(f"mode must be one of {MODES}, got {show(mode)}")
    if upper is not None and (isinstance(upper, bool) or not isinstance(upper, int) or not 1 <= upper <= MAX_UPPER):
        raise PlanError(f"upper must be a whole number in [1, {MAX_UPPER}], got {show(upper)}")


def measure_peak(
    workload: "Workload", plan: "Plan", mode: str = "fake", *, cancel_event: "threading.Event | None" = None
) -> "Measurement":
    """One measurement of ``plan`` on ``workload`` (steady state when the engine offers it).

    Holds the model's lock (``measure.engine.model_lock``) around ``Plan.apply`` and the step, as
    ``Session.run`` does, so a search on a worker thread and an explorer rerun take turns on one
    model. ``cancel_event`` (set from another thread) stops it with ``Cancelled``."""
    from memsave_nb.measure import measure
    from memsave_nb.measure.engine import model_lock

    check_search_args(plan, mode=mode)
    if cancel_event is not None and cancel_event.is_set():
        raise Cancelled("cancelled")
    kwargs: dict[str, Any] = {"repeats": 0, "cancel_event": cancel_event}
    params = inspect.signature(measure).parameters
    if "steady_state" in params:
        kwargs["steady_state"] = True
    if "flops" in params:
        kwargs["flops"] = False
    with model_lock(workload.model), plan.apply(workload) as applied:
        return measure(applied, mode=mode, **kwargs)


def _bisect(
    knob: str,
    probe: "Callable[[int], Measurement | None]",
    target: Target,
    start: int,
    upper: int,
    limit: str,
) -> SearchResult:
    """Exponential search up from ``start``, then bisection; each probe judged by ``fit_of`` (the
    verdict's own test), so the value found is one whose verdict says "fits"."""
    probes: list[tuple[int, int | None]] = []
    peaks: dict[int, int | None] = {}
    fit: dict[int, bool] = {}
    rules: dict[str, None] = {}

    def ok(v: int) -> bool:
        if v not in peaks:
            m = probe(v)
            peaks[v] = None if m is None else m.peak_bytes
            probes.append((v, peaks[v]))
            if m is None:
                fit[v] = False
            else:
                answer = fit_of(target, m, fixes=False)
                fit[v] = answer.fits
                rules[answer.rule] = None
        return fit[v]

    def done(value: int, why: str) -> SearchResult:
        return SearchResult(knob, value, peaks[value or 1], tuple(probes), why, rule=" and ".join(rules))

    if not ok(1):
        return done(0, "even 1 does not fit")
    lo, hi = 1, None
    v = max(1, start)
    while hi is None:  # exponential search up from the current value
        if v > upper:
            v = upper
        if ok(v):
            lo = v
            if v >= upper:
                return done(upper, limit)
            v *= 2
        else:
            hi = v
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return done(lo, "")


def max_batch(
    workload: "Workload",
    plan: "Plan",
    target: Target,
    *,
    mode: str = "fake",
    upper: int = 1 << 16,
    cancel_event: threading.Event | None = None,
    measured: "dict[int, Measurement] | None" = None,
) -> SearchResult:
    """The largest batch size that fits ``target`` under ``plan`` (bisection over measurements).
    ``cancel_event`` stops it between and inside probes (``Cancelled``). ``measured``: batch size
    -> a steady-state measurement of ``plan`` at that batch in ``mode`` the caller already holds
    (the report's own): taken as that probe instead of measuring it again."""
    from memsave_nb.knobs import batch_size_of

    check_search_args(plan, target, mode, upper)
    current = plan.batch_size or _current(lambda: batch_size_of(_raw_batch(workload)), 1)

    notes: dict[str, None] = {}

    def probe(b: int) -> "Measurement | None":
        if measured and b in measured:
            return _with_notes(measured[b], notes)
        return _probe(workload, plan.replace(batch_size=b), mode, cancel_event, notes)

    result = _bisect("batch_size", probe, target, current, upper, f"stopped at the search's upper bound {upper}")
    return dataclasses.replace(result, notes=tuple(notes))


def max_seq_len(
    workload: "Workload",
    plan: "Plan",
    target: Target,
    *,
    mode: str = "fake",
    upper: int | None = None,
    cancel_event: threading.Event | None = None,
) -> SearchResult:
    """The longest token sequence that fits ``target`` under ``plan``; capped by the model's
    position embeddings when its config names them."""
    from memsave_nb.knobs import max_positions, seq_len_of

    check_search_args(plan, target, mode, upper)
    current = plan.seq_len or seq_len_of(_raw_batch(workload))
    positions = max_positions(workload.model)
    if upper is None:
        upper = positions or 1 << 20
    limit = f"the model's {positions} positions" if positions == upper else f"the search's upper bound {upper}"

    notes: dict[str, None] = {}

    def probe(t: int) -> "Measurement | None":
        return _probe(workload, plan.replace(seq_len=t), mode, cancel_event, notes)

    result = _bisect("seq_len", probe, target, current, upper, limit)
    return dataclasses.replace(result, notes=tuple(notes))


# notes of a probe's measurement that bear on where the boundary lies (kept on the result)
_BOUNDARY_NOTES = ("single-tensor step",)


def _probe(
    workload: "Workload", plan: "Plan", mode: str, cancel_event: threading.Event | None, notes: dict[str, None]
) -> "Measurement | None":
    """One probe's measurement (None when the step fails with a MemsaveError); its boundary notes
    are added to ``notes`` (an ordered set)."""
    from memsave_nb.errors import MemsaveError

    try:
        m = measure_peak(workload, plan, mode, cancel_event=cancel_event)
    except Cancelled:
        raise
    except MemsaveError:
        return None
    return _with_notes(m, notes)


def _with_notes(m: "Measurement", notes: dict[str, None]) -> "Measurement":
    for note in m.notes:
        if any(key in note for key in _BOUNDARY_NOTES):
            notes[note] = None
    return m


def _raw_batch(workload: "Workload") -> Any:
    batch = workload.batch
    if callable(batch) and not hasattr(batch, "shape"):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            return batch()
    return batch


def _current(fn: Callable[[], int], default: int) -> int:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return default


# -- the verdict from the allocator model's replay (issue 40, part 3) ---------------------------
# What no tracker sees, added to the replay's reserved memory. Sources: docs/allocator.md.
CUDA_CONTEXT_BYTES = 500 * 2**20
CUDA_CONTEXT_SOURCE = "context and kernels: about 300-500 MB per GPU, the upper end taken; no tracker sees it"
COMM_BUFFER_BYTES = 512 * 2**20
COMM_BUFFER_SOURCE = "about 0.5 GB per communicator, a published estimate"
# settings tried when the step does not fit as it is, in this order
ALLOC_KNOBS = ("expandable_segments:True", "max_split_size_mb:512", "max_split_size_mb:128")


@dataclass(frozen=True)
class ReservedVerdict:
    """Predicted reserved memory + CUDA context + communication buffers against the whole GPU.

    ``fits``: the replay under the GPU's capacity (less context and buffers) never ran out, after
    the out-of-memory retries torch makes. ``fragmentation_only``: the rounded allocations would
    fit but the cached, split segments do not; ``fix``: a ``PYTORCH_CUDA_ALLOC_CONF`` that fits."""

    target: Target
    reserved_bytes: int
    allocated_bytes: int
    context_bytes: int
    comm_bytes: int
    communicators: int
    fits: bool
    alloc_conf: str = ""
    fragmentation_only: bool = False
    fix: str = ""
    workspace_bytes: int = 0  # inside reserved_bytes: the cuBLAS workspace replayed with the step
    workspace_source: str = ""

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + self.context_bytes + self.comm_bytes

    @property
    def frees_cache(self) -> bool:
        """Fits although the uncapped replay reserves more than the card: under the card's size
        torch frees cached segments when an allocation fails and retries, and the replay fits."""
        return self.fits and self.total_bytes > self.target.total_bytes

    def headline(self) -> str:
        """``fits (X of Y; ...)``; where the uncapped figure is over the card (``frees_cache``), the
        allocations and the line instead ("fits (80.9 GiB of 80.0 GiB)" read as a contradiction)."""
        from memsave_nb.units import format_bytes as fb

        if self.frees_cache:
            line = self.target.total_bytes - self.context_bytes - self.comm_bytes
            return (
                f"fits: peak allocated {fb(self.allocated_bytes)}; the allocator would free cached blocks to stay "
                f"under {fb(line)} ({self.target.label} less the CUDA context"
                + (" and buffers" if self.comm_bytes else "")
                + ")"
            )
        return f"{'fits' if self.fits else 'does not fit'} ({fb(self.total_bytes)} of {fb(self.target.total_bytes)}"

    def lines(self) -> tuple[str, ...]:
        from memsave_nb.units import format_bytes as fb

        conf = f", PYTORCH_CUDA_ALLOC_CONF={self.alloc_conf}" if self.alloc_conf else ""
        how = "replayed through the caching-allocator model, no 80% rule"
        out = [
            f"Target {self.target.label}: {self.headline()}; {how}" + ("" if self.frees_cache else ")"),
            (
                f"  predicted reserved memory: {fb(self.reserved_bytes)} (allocator model{conf}; "
                f"allocated {fb(self.allocated_bytes)})"
            ),
            f"  CUDA context: {fb(self.context_bytes)} ({CUDA_CONTEXT_SOURCE})",
        ]
        if self.workspace_bytes:
            out.append(
                f"  cuBLAS workspace: {fb(self.workspace_bytes)}, inside the predicted reserved ({self.workspace_source})"
            )
        if self.communicators:
            out.append(f"  communication buffers: {fb(self.comm_bytes)} ({self.communicators} x {COMM_BUFFER_SOURCE})")
        if self.fragmentation_only:
            out.append(
                "  fragmentation alone makes it not fit: the allocations fit, the cached segments do not"
                + (f"; PYTORCH_CUDA_ALLOC_CONF={self.fix} fits" if self.fix else "; no setting tried fits")
            )
        elif self.fix:
            out.append(f"  PYTORCH_CUDA_ALLOC_CONF={self.fix} fits")
        if self.frees_cache:
            out.append(
                f"  uncapped, the replay reserves {fb(self.total_bytes)} with the context; under "
                f"{self.target.label} torch frees cached segments when it would run out, and the step fits"
            )
        return tuple(out)


def _replay_fits(ops: Any, conf: str, capacity: int) -> bool:
    from memsave_nb.measure.cuda_allocator import AllocatorOOM
    from memsave_nb.measure.reserved import run_ops, settings_of

    if capacity <= 0:
        return False
    try:
        run_ops(ops, settings_of(conf)[0], capacity)
    except AllocatorOOM:
        return False
    return True


def reserved_verdict(
    target: Target, measurement: "Measurement", *, communicators: int = 0, fixes: bool = True
) -> ReservedVerdict | None:
    """The verdict from the allocator model, or None where no replay exists (the compiled route,
    an old result): then the 80% rule (``Target.verdict``) is what there is. ``fixes=False``
    skips trying other allocator settings when it does not fit (the searches need only the word)."""
    r = getattr(measurement, "reserved", None)
    if r is None or not r.ops:
        return None
    return verdict_of_replay(
        target, r, lambda conf, capacity: _replay_fits(r.ops, conf, capacity), communicators=communicators, fixes=fixes
    )


def verdict_of_replay(
    target: Target,
    r: Any,
    replay_fits: Callable[[str, int], bool],
    *,
    communicators: int = 0,
    fixes: bool = True,
) -> ReservedVerdict:
    """The replay's verdict for a step's reserved-memory record ``r`` (one GPU's or one rank's):
    ``replay_fits(alloc_conf, capacity)`` replays its ops under that capacity (the whole GPU less
    the CUDA context and ``communicators`` sets of buffers); where it does not fit, each
    ``ALLOC_KNOBS`` setting is tried in turn (``fixes``)."""
    comm = COMM_BUFFER_BYTES * communicators
    capacity = target.total_bytes - CUDA_CONTEXT_BYTES - comm
    fits = replay_fits(r.alloc_conf, capacity)
    fix, frag = "", False
    if not fits and fixes:
        frag = 0 < r.max_allocated_bytes <= capacity
        base = r.alloc_conf.strip(", ")
        for knob in ALLOC_KNOBS:
            conf = f"{base},{knob}" if base else knob
            if replay_fits(conf, capacity):
                fix = conf
                break
    return ReservedVerdict(
        target,
        r.max_reserved_bytes,
        r.max_allocated_bytes,
        CUDA_CONTEXT_BYTES,
        comm,
        communicators,
        fits,
        r.alloc_conf,
        frag,
        fix,
        getattr(r, "workspace_bytes", 0),
        getattr(r, "workspace_source", ""),
    )


# -- one fit test for the verdict and every search (issue 40, part 3) ---------------------------
RULE_REPLAY = "allocator replay"
RULE_80 = "80% rule"


@dataclass(frozen=True)
class Fit:
    """Whether a measured step fits ``target``, and by which rule: the allocator replay where the
    measurement carries one (``replay``), else the headroom line ("80% rule", no replay)."""

    fits: bool
    rule: str
    peak_bytes: int
    replay: ReservedVerdict | None = None

    def verdict(self, target: Target) -> str:
        """``"fits (...)"`` / ``"does not fit (...)"``, saying which rule decided."""
        if self.replay is not None:
            fix = f"; PYTORCH_CUDA_ALLOC_CONF={self.replay.fix} fits" if self.replay.fix else ""
            if self.replay.frees_cache:
                return f"{self.replay.headline()}; allocator replay, no 80% rule{fix}"
            return f"{self.replay.headline()}; allocator replay + CUDA context, no 80% rule){fix}"
        return f"{target.verdict(self.peak_bytes)}; 80% rule, no allocator replay"


def fit_of(target: Target, measurement: "Measurement", *, communicators: int = 0, fixes: bool = True) -> Fit:
    """THE fit test: the report's verdict, the max batch / sequence searches, the planner's
    re-measured choice and the "what would fit" hints all call this, so one screen gives one
    answer. The replay's verdict where the step was replayed, the 80% rule otherwise."""
    replay = reserved_verdict(target, measurement, communicators=communicators, fixes=fixes)
    if replay is not None:
        return Fit(replay.fits, RULE_REPLAY, measurement.peak_bytes, replay)
    return Fit(target.fits(measurement.peak_bytes), RULE_80, measurement.peak_bytes)


def replay_line_bytes(target: Target, communicators: int = 0) -> int:
    """What the replayed step may reserve: the whole GPU less the CUDA context and buffers."""
    return target.total_bytes - CUDA_CONTEXT_BYTES - COMM_BUFFER_BYTES * communicators


def estimate_fits(target: Target, estimated_bytes: int | float) -> bool:
    """An estimated peak (no step run, so no replay yet) against the line its measured step will
    face in ``fit_of``: reserved memory is never below the allocations, so an estimate over it
    cannot fit, and one under it is re-measured before anyone is told it fits."""
    return estimated_bytes <= replay_line_bytes(target)
