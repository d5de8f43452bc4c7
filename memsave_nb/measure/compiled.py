"""Measure a step whose model runs under ``torch.compile``.

Inside a compiled graph allocations bypass Python dispatch, so the storage tracker sees nothing.
Here the step runs under ``torch.profiler`` with ``profile_memory=True``: every allocation and
free on the workload's device comes back as an event (pointer, size, time). Marks
(``record_function``) split the step into forward, backward and optimizer; categories are decided
as the engine decides them:

- parameters, buffers and the batch exist before the step (their bytes are known from the model),
- an allocation made during forward and still alive when forward ends is an *activation*
  (saved for backward), or an *output* when it is the storage of a tensor the model returned
  (or the loss): the graph's saved tensors are hidden from hooks here, so an output the graph
  also saved counts as an output,
- allocations that are the parameters' ``.grad`` or the optimizer's state after the step are
  *gradients* / *optimizer state*,
- everything else is a *temporary*.

On CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``) is reported too.
Per-module and per-op attribution is not available for compiled steps: module rows carry
parameter counts and the root row the total.

The first call compiles (slow); it runs untracked before the measured step. As with
:func:`memsave_nb.measure.measure`, the measured step is training's steady state by default: one
profiled first step makes the optimizer's state (its peak is ``first_step_peak_bytes``), grads are
cleared per ``Workload.set_to_none``, and the second step is the one measured, with the optimizer
state (and zeroed grads) counted from its start. ``accumulation_steps`` k runs k micro-steps
(forward, loss / k, backward) before the optimizer, as the engine does. The model is left exactly
as it was (values, grads, flags, modes).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any

import torch
from torch import nn

from ..errors import Cancelled, MemsaveError, StepError, WorkloadError
from ..model_state import ModelSnapshot
from ..workload import Workload, iter_output_tensors, iter_tensors
from .common import clear_grads
from .training_step import training_step
from .result import CATEGORIES, Measurement, MemorySplit, ModuleStats, Timeline

__all__ = ["measure_compiled", "original_model"]

_MARK = "memsave::"


def original_model(model: nn.Module) -> nn.Module:
    """The user's module behind a ``torch.compile`` wrapper (the module itself otherwise)."""
    return getattr(model, "_orig_mod", model)


def measure_compiled(
    workload: Workload,
    mode: str = "real",
    *,
    repeats: int = 3,
    warmup: int = 2,
    cancel_event: threading.Event | None = None,
    steady_state: bool = True,
) -> Measurement:
    """Measure one training step of ``workload`` (its model compiled or not) from the profiler's
    memory events; ``repeats`` untracked steps give the median step time.

    ``warmup`` untimed steps run first so that compilation is not measured. ``steady_state``: see
    the module docstring (``False`` measures the first step, optimizer state made inside it).
    """
    if mode != "real":
        raise WorkloadError("a compiled step can only be measured for real (mode='real'): fake tensors do not compile")
    if not isinstance(steady_state, bool):
        raise WorkloadError(f"steady_state must be True or False, got {steady_state!r}")
    model = original_model(workload.model)
    snapshot = ModelSnapshot.capture(model, copy_values=True)
    first_peak = None
    try:
        for _ in range(max(0, warmup)):
            _check(cancel_event)
            _Loop(workload, cancel_event).step(profile=False)
            snapshot.restore(model)
        loop = _Loop(workload, cancel_event)
        if steady_state:
            first = loop.step(profile=True)
            first_peak = _peak_of(first)
            loop.zero_grad()
        profiled = loop.step(profile=True)
        del loop
        snapshot.restore(model)
        times = []
        for _ in range(max(0, repeats)):
            _check(cancel_event)
            start = time.perf_counter()
            _Loop(workload, cancel_event).step(profile=False)
            times.append(time.perf_counter() - start)
            snapshot.restore(model)
    finally:
        snapshot.restore(model)
    m = _summarise(workload, model, profiled, times)
    if first_peak is None:
        first_peak = m.peak_bytes
    return dataclasses.replace(m, first_step_peak_bytes=first_peak, steady_state=steady_state)


def _check(cancel_event: threading.Event | None) -> None:
    if cancel_event is not None and cancel_event.is_set():
        raise Cancelled("run cancelled")


class _Profiled:
    """What one profiled step left: allocation events, phase marks, which storages are grads /
    optimizer state / outputs at the end, the bytes that existed before it, CUDA's own figures."""

    def __init__(self, events, marks, grad_ptrs, opt_ptrs, out_ptrs, static, cuda):
        self.events, self.marks = events, marks  # marks: name -> [(start ns, end ns), ...]
        self.grad_ptrs, self.opt_ptrs, self.out_ptrs = grad_ptrs, opt_ptrs, out_ptrs
        self.static, self.cuda = static, cuda


class _Loop:
    """One training loop: the optimizer is made once and keeps its state from step to step."""

    def __init__(self, workload: Workload, cancel_event: threading.Event | None):
        self.workload = workload
        self.cancel_event = cancel_event
        self.model = original_model(workload.model)
        for p in self.model.parameters():
            p.grad = None
        self.optimizer = workload.make_optimizer()

    def zero_grad(self) -> None:
        """Between steps, as ``zero_grad(set_to_none=workload.set_to_none)`` does."""
        clear_grads(self.model, self.workload.set_to_none)

    def step(self, *, profile: bool) -> _Profiled | None:
        from torch.profiler import ProfilerActivity, record_function

        workload, model, optimizer = self.workload, self.model, self.optimizer
        on_cuda = torch.device(workload.device).type == "cuda"
        # what exists before the step: parameters, the optimizer's state, grads kept as zeros
        static = _static_bytes(model, optimizer)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        cuda: dict[str, int] = {}
        phase = "forward"
        out_ptrs: set[int] = set()
        batch_storages: dict[int, int] = {}
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            cuda["baseline"] = torch.cuda.memory_allocated()
        prof = (
            torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False) if profile else None
        )
        try:
            if prof is not None:
                prof.__enter__()
            try:

                def next_batch(last: bool) -> Any:
                    nonlocal batch_storages
                    # the batch exists before its micro-step in a loop: made outside the marks
                    with record_function(_MARK + "batch"):
                        batch = workload.make_batch()
                    if last:
                        batch_storages = {_ptr(t): t.untyped_storage().nbytes() for t in iter_tensors(batch)}
                    return batch

                def on_phase(name: str, last: bool) -> None:
                    nonlocal phase
                    if name in ("backward", "optimizer", "done") or not first_forward:
                        _check(self.cancel_event)  # after each forward and each backward
                    first_forward.clear()
                    phase = "forward" if name == "loss" else name

                def context(name: str, last: bool) -> Any:
                    return record_function(_MARK + (name if last else "micro"))

                def forward_end(output: Any, loss: torch.Tensor) -> None:
                    nonlocal out_ptrs
                    out_ptrs = {_ptr(t) for t in iter_output_tensors((output, loss))}

                first_forward = [True]
                # the last batch, output and loss live on to the end of the profile, as in the loop
                left = training_step(  # noqa: F841 (held to the end of the profile)
                    workload,
                    next_batch,
                    optimizer,
                    runner="compiled",
                    on_phase=on_phase,
                    context=context,
                    on_forward_end=forward_end,
                )
                if on_cuda:
                    torch.cuda.synchronize()
                    cuda["peak"] = torch.cuda.max_memory_allocated()
            finally:
                if prof is not None:
                    prof.__exit__(None, None, None)
        except (MemsaveError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - reworded with the phase, cause kept
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            kind = "out of memory" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
            raise StepError(f"compiled step failed during {phase}: {kind}: {first}", phase=phase, cause=exc) from exc
        if prof is None:
            return None
        grad_ptrs = {_ptr(p.grad) for p in model.parameters() if p.grad is not None}
        opt_ptrs = set()
        if optimizer is not None:
            opt_ptrs = {_ptr(t) for s in optimizer.state.values() for t in iter_tensors(s)}
        events, marks = _memory_events(prof, torch.device(workload.device).type)
        # the batch's storages made inside the step are counted from their events; the rest
        # (a batch of the user's tensors, the same every step) existed before it
        made = {ptr for t, ptr, size in events if size > 0 and any(a <= t <= b for a, b in marks.get("batch", []))}
        static["inputs"] = sum(n for ptr, n in batch_storages.items() if ptr not in made)
        return _Profiled(events, marks, grad_ptrs, opt_ptrs, out_ptrs, static, cuda)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _nbytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        key = id(s) if s.data_ptr() == 0 else s.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += s.nbytes()
    return total


def _static_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    seen: set[int] = set()
    params = _nbytes(list(model.parameters()) + list(model.buffers()), seen)
    state = (
        _nbytes((t for s in optimizer.state.values() for t in iter_tensors(s)), seen) if optimizer is not None else 0
    )
    grads = _nbytes((p.grad for p in model.parameters()), seen)
    return {"parameters": params, "optimizer_state": state, "gradients": grads, "inputs": 0}


def _peak_of(step: _Profiled) -> int:
    """The step's peak live bytes: what existed before it plus its own allocations' running sum."""
    live = peak = sum(step.static.values())
    born: dict[int, int] = {}
    for _, ptr, size in step.events:
        if size > 0:
            born[ptr] = size
            live += size
        elif ptr in born:
            live -= born.pop(ptr)
        peak = max(peak, live)
    return peak


def _memory_events(prof: Any, device_type: str) -> tuple[list[tuple[int, int, int]], dict[str, list[tuple[int, int]]]]:
    """(time ns, ptr, +/- bytes) for allocations on ``device_type``; each mark's (start, end)s in time order."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    marks: dict[str, list[tuple[int, int]]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device_type and f.alloc_size != 0:
                events.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif e.name.startswith(_MARK):
            marks.setdefault(e.name[len(_MARK) :], []).append((e.start_time_ns, e.end_time_ns))
    # stable in time; at equal times keep allocations after frees of the same pointer
    events.sort(key=lambda ev: (ev[0], ev[2] > 0))
    for spans in marks.values():
        spans.sort()
    return events, marks


def _summarise(workload: Workload, model: nn.Module, step: _Profiled, times: list[float]) -> Measurement:
    events, cuda, static = step.events, step.cuda, step.static
    grad_ptrs, opt_ptrs, out_ptrs = step.grad_ptrs, step.opt_ptrs, step.out_ptrs
    marks = {name: spans[-1] for name, spans in step.marks.items()}  # the last micro-step's phases
    batch_spans = step.marks.get("batch", [])
    fwd_start, fwd_end = marks.get("forward", (0, 0))

    def phase_of(t: int) -> str:
        for name in ("optimizer", "backward", "forward"):
            if name in marks and t >= marks[name][0]:
                return name
        return "forward"

    # 1. allocations: (born time, ptr, size); decide each one's category after the step
    allocs: list[dict[str, Any]] = []
    live: dict[int, dict[str, Any]] = {}
    for t, ptr, size in events:
        if size > 0:
            rec = {"born": t, "ptr": ptr, "size": size, "died": None}
            allocs.append(rec)
            live[ptr] = rec
        else:
            rec = live.pop(ptr, None)
            if rec is not None:
                rec["died"] = t
    for rec in allocs:
        alive_at_fwd_end = rec["born"] <= fwd_end and (rec["died"] is None or rec["died"] > fwd_end)
        if any(lo <= rec["born"] <= hi for lo, hi in batch_spans):
            rec["kind"] = "inputs"
        elif rec["died"] is None and rec["ptr"] in grad_ptrs:
            rec["kind"] = "gradients"
        elif rec["died"] is None and rec["ptr"] in opt_ptrs:
            rec["kind"] = "optimizer_state"
        elif fwd_start <= rec["born"] <= fwd_end and alive_at_fwd_end:
            rec["kind"] = "outputs" if rec["ptr"] in out_ptrs else "activations"
        else:
            rec["kind"] = "temporaries"

    # 2. replay: live bytes per category after each event
    by_ptr_live: dict[int, dict[str, Any]] = {}
    current = {c: 0 for c in CATEGORIES}
    for category, value in static.items():
        current[category] += value
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    phases: list[str] = []
    phase_starts: dict[str, int] = {}
    peak, peak_index, peak_split = sum(current.values()), 0, dict(current)
    fwd_end_split = dict(current)
    alloc_iter = iter(allocs)
    for t, ptr, size in events:
        if size > 0:
            rec = next(alloc_iter)
            by_ptr_live[ptr] = rec
            current[rec["kind"]] += size
        else:
            rec = by_ptr_live.pop(ptr, None)
            if rec is None:
                continue  # freed something born before the step: not ours to count
            current[rec["kind"]] -= rec["size"]
        phase = phase_of(t)
        phase_starts.setdefault(phase, len(phases))
        phases.append(phase)
        for c in CATEGORIES:
            series[c].append(current[c])
        total = sum(current.values())
        if total > peak:
            peak, peak_index, peak_split = total, len(phases) - 1, dict(current)
        if t <= fwd_end:
            fwd_end_split = dict(current)
    saved = sum(r["size"] for r in allocs if r["kind"] == "activations")
    outputs = sum(r["size"] for r in allocs if r["kind"] == "outputs")

    # 3. module rows: parameter counts; saved bytes only at the root
    rows = []
    for name, mod in model.named_modules():
        own = [p for p in mod._parameters.values() if p is not None]
        rows.append(
            ModuleStats(
                name=name,
                type_name=type(mod).__name__,
                depth=0 if name == "" else name.count(".") + 1,
                output_shape=None,
                trainable_params=sum(p.numel() for p in own if p.requires_grad),
                frozen_params=sum(p.numel() for p in own if not p.requires_grad),
                saved_bytes_own=saved if name == "" else 0,
                saved_bytes=saved if name == "" else 0,
                calls=0,
                is_leaf=not any(True for _ in mod.children()),
                output_bytes_own=outputs if name == "" else 0,
                output_bytes=outputs if name == "" else 0,
                trainable_params_subtree=sum(p.numel() for p in mod.parameters() if p.requires_grad),
                frozen_params_subtree=sum(p.numel() for p in mod.parameters() if not p.requires_grad),
            )
        )
    compiled = hasattr(workload.model, "_orig_mod")
    return Measurement(
        mode="real",
        device=str(workload.device),
        peak_bytes=peak,
        peak_split=MemorySplit(**peak_split),
        peak_index=peak_index,
        peak_phase=phases[peak_index] if phases else "",
        saved_bytes=saved,
        end_of_forward=MemorySplit(**fwd_end_split),
        modules=tuple(rows),
        ops=(),
        module_ops=(),
        timeline=Timeline(
            phase=tuple(phases), by_category={c: tuple(v) for c, v in series.items()}, phase_starts=phase_starts
        ),
        step_seconds=statistics.median(times) if times else None,
        step_seconds_all=tuple(times),
        flops=0,
        cuda_peak_bytes=cuda.get("peak"),
        cuda_baseline_bytes=cuda.get("baseline"),
        compiled=compiled,
        output_bytes=outputs,
        notes=(
            "measured from profiler memory events"
            + (" of a torch.compile'd model" if compiled else "")
            + ": no per-module or per-op attribution",
        )
        + _cuda_attention_note(workload)
        + _cuda_autocast_note(workload),
    )


def _cuda_attention_note(workload: Workload) -> tuple[str, ...]:
    """A step sized for CUDA that ran here on CPU tensors: its attention was the CPU's kernel. The
    engine and the per-rank runner answer SDPA with CUDA's choice (``cuda_attention``) on fake
    tensors only (CUDA's kernels have no CPU implementation), and a compiled step cannot be faked."""
    if workload.sized_for != "cuda" or torch.device(workload.device).type == "cuda":
        return ()
    return (
        f"sized for CUDA ({workload.gpu or 'the default GPU'}), but this step ran real tensors on "
        f"{torch.device(workload.device).type}: scaled_dot_product_attention ran this device's kernel, not the one "
        "CUDA would pick (that choice is made in fake mode only, and a compiled step cannot be faked)",
    )


def _cuda_autocast_note(workload: Workload) -> tuple[str, ...]:
    """A step sized for CUDA under autocast that ran compiled on CPU tensors: autocast's CPU op lists
    were traced into the graph. The engine follows CUDA's lists by replacing autocast's kernels
    (``cuda_autocast``), but a graph compiled earlier, without them, would be reused as it is."""
    if workload.sized_for != "cuda" or workload.autocast_dtype is None or torch.device(workload.device).type == "cuda":
        return ()
    return (
        f"sized for CUDA, but this compiled step ran autocast's {torch.device(workload.device).type} op lists, "
        "not CUDA's: layer_norm, softmax, sum, pow, exp, ... kept the low dtype here where CUDA runs and saves them "
        "in fp32 (CUDA's lists are followed by the uncompiled engine and the per-rank runners only)",
    )
