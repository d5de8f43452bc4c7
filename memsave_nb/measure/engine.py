"""``measure()``: run one training step for real or with fake tensors, under the tracker.

The step is forward, loss, backward and (when the workload has one) the optimizer's first step.
Everything it changes in the model (weights, batch-norm statistics, grads) is put back afterwards.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import Cancelled, MemsaveError, StepError, WorkloadError
from ..model_state import ModelSnapshot
from ..workload import Workload, iter_tensors, map_tensors
from .result import CATEGORIES, Measurement, MemorySplit, ModuleStats, OpStats, Timeline
from .tracker import INPUT, PARAMETER, MemoryTracker

MODES = ("real", "fake")


def measure(
    workload: Workload,
    mode: str = "real",
    *,
    repeats: int = 3,
    flops: bool = True,
    cancel_event: threading.Event | None = None,
) -> Measurement:
    """Measure one training step of ``workload``: peak and its split, saved activations per
    module and op, a live-bytes timeline, FLOPs and (real mode) the median step time.

    ``mode="fake"`` runs the same step under ``FakeTensorMode``: shapes and bytes without memory
    or compute, for models too large for this machine. The model is left as it was.
    """
    if mode not in MODES:
        raise WorkloadError(f"unknown mode {mode!r}; choose 'real' or 'fake'")
    if _is_compiled(workload.model):
        # Inside a compiled graph allocations bypass Python dispatch: count them from the
        # profiler's memory events instead (no per-module rows there).
        if mode == "fake":
            raise WorkloadError("a torch.compile'd model cannot be measured in fake mode; measure it in real mode")
        from .compiled import measure_compiled

        return measure_compiled(workload, mode=mode, repeats=repeats, cancel_event=cancel_event)
    model = workload.model
    if mode == "real" and _has_fake_tensors(model):
        raise WorkloadError(
            f"the model of {workload.name!r} holds fake or meta tensors (built under FakeTensorMode or on the meta device): measure it with mode='fake'"
        )
    snapshot = ModelSnapshot.capture(model, copy_values=(mode == "real"))
    try:
        if mode == "fake":
            with _fake_model(model) as fake_mode:
                tracker, cuda = _tracked_step(workload, fake_mode=fake_mode, flops=flops, cancel_event=cancel_event)
            times: list[float] = []
        else:
            tracker, cuda = _tracked_step(workload, fake_mode=None, flops=flops, cancel_event=cancel_event)
            snapshot.restore(model)
            times = [_timed_step(workload, cancel_event) for _ in range(max(0, repeats))]
    finally:
        snapshot.restore(model)
    return _summarise(tracker, workload, mode, times, cuda)


def _is_compiled(model: nn.Module) -> bool:
    """A ``torch.compile``'d module (an ``OptimizedModule`` wrapper)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, OptimizedModule)


# -- the step ----------------------------------------------------------------------------------


class _Step:
    """One forward/backward/optimizer step with phase bookkeeping shared by tracked and timed runs."""

    def __init__(self, workload: Workload, tracker: MemoryTracker | None, cancel_event: threading.Event | None):
        self.workload = workload
        self.tracker = tracker
        self.cancel_event = cancel_event
        self.phase = "setup"

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.tracker is not None:
            self.tracker.phase = phase
        if self.cancel_event is not None and self.cancel_event.is_set():
            raise Cancelled("run cancelled")

    def run(self, batch: Any, on_forward_end: Callable[[Any], None] | None = None) -> dict[str, Any]:
        wl = self.workload
        if not any(p.requires_grad for p in wl.model.parameters()) and not any(
            t.requires_grad for t in iter_tensors(batch)
        ):
            raise WorkloadError(
                "nothing to differentiate: every parameter is frozen and the input does not require grad"
            )
        optimizer = wl.make_optimizer()
        self.set_phase("forward")
        output = wl.forward(batch)
        loss = wl.compute_loss(output)
        if not loss.requires_grad:
            raise WorkloadError("the loss does not depend on anything that requires grad")
        if on_forward_end is not None:
            on_forward_end(loss)
        self.set_phase("backward")
        loss.backward()
        state: dict[str, Any] = {"grads": [p.grad for p in wl.model.parameters() if p.grad is not None]}
        if optimizer is not None:
            self.set_phase("optimizer")
            optimizer.step()
            state["optimizer_state"] = [t for s in optimizer.state.values() for t in iter_tensors(s)]
        self.set_phase("done")
        del output, loss
        return state


def _tracked_step(workload: Workload, *, fake_mode, flops: bool, cancel_event) -> tuple[MemoryTracker, dict]:
    model = workload.model
    tracker = MemoryTracker(model, count_flops=flops)
    tracker.register_existing(model.parameters(), PARAMETER)
    tracker.register_existing((b for b in model.buffers() if b is not None), PARAMETER)
    for p in model.parameters():
        p.grad = None
    cuda: dict[str, int] = {}
    on_cuda = torch.device(workload.device).type == "cuda" and fake_mode is None
    step = _Step(workload, tracker, cancel_event)
    grad_records: set[int | None] = set()
    opt_records: set[int | None] = set()
    end_of_forward: dict[str, Any] = {}
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            batch = _make_batch(workload, fake_mode)
            tracker.register_existing(iter_tensors(batch), INPUT)
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                cuda["baseline"] = torch.cuda.memory_allocated()

            def mark_forward_end(loss: torch.Tensor) -> None:
                end_of_forward["event"] = len(tracker.events)
                end_of_forward["live"] = tracker.live_records()

            with tracker:
                state = step.run(batch, mark_forward_end)
                grad_records = {tracker.record_of(g) for g in state["grads"]}
                # an input that requires grad keeps its .grad too: a gradient, not a temporary
                grad_records |= {tracker.record_of(t.grad) for t in iter_tensors(batch) if t.grad is not None}
                opt_records = {tracker.record_of(t) for t in state.get("optimizer_state", [])}
                if on_cuda:
                    torch.cuda.synchronize()
                    cuda["peak"] = torch.cuda.max_memory_allocated()
                del state
            del batch
    except (MemsaveError, KeyboardInterrupt):
        raise
    except torch.OutOfMemoryError as exc:
        raise _step_error(exc, step.phase, tracker, "out of memory") from exc
    except Exception as exc:  # noqa: BLE001 - reworded with phase and module, cause kept
        raise _step_error(exc, step.phase, tracker) from exc
    finally:
        tracker.module_stack.clear()
    tracker.grad_records = grad_records - {None}  # type: ignore[attr-defined]
    tracker.opt_records = opt_records - {None}  # type: ignore[attr-defined]
    tracker.forward_end = end_of_forward  # type: ignore[attr-defined]
    return tracker, cuda


def _timed_step(workload: Workload, cancel_event) -> float:
    snapshot = ModelSnapshot.capture(workload.model, copy_values=False)
    for p in workload.model.parameters():
        p.grad = None
    batch = workload.make_batch()
    on_cuda = torch.device(workload.device).type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    state = _Step(workload, None, cancel_event).run(batch)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del state, batch
    for k, t in snapshot.tensors.items():
        if k.startswith("p:"):
            t.grad = None
    return elapsed


def _make_batch(workload: Workload, fake_mode) -> Any:
    if fake_mode is None:
        return workload.make_batch()
    # Under fake mode: a factory builds fake tensors directly; real tensors are converted.
    raw = workload.batch() if callable(workload.batch) else workload.batch
    converted = map_tensors(raw, lambda t: t if _is_fake(t) else fake_mode.from_tensor(t))
    return workload.replace(batch=converted).make_batch()


def _step_error(exc: BaseException, phase: str, tracker: MemoryTracker, what: str | None = None) -> StepError:
    module = tracker.current_module()
    where = f"in module {module!r}" if module else "outside any module"
    if module and tracker._model is not None:
        try:
            where += f" ({type(tracker._model.get_submodule(module)).__name__})"
        except AttributeError:
            pass
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    kind = what or type(exc).__name__
    return StepError(f"step failed during {phase} {where}: {kind}: {first_line}", phase=phase, module=module, cause=exc)


# -- fake mode -----------------------------------------------------------------------------------


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _has_fake_tensors(model: nn.Module) -> bool:
    return any(_is_fake(t) or t.device.type == "meta" for t in _params_and_buffers(model))


def _params_and_buffers(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


@contextlib.contextmanager
def _fake_model(model: nn.Module) -> Iterator[Any]:
    """Swap parameters and buffers for fake twins (same shapes, dtypes, devices); swap back on exit.

    A model built under ``FakeTensorMode`` already has fake tensors: its own mode is reused.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    existing = next((t.fake_mode for t in list(model.parameters()) + list(model.buffers()) if _is_fake(t)), None)
    if existing is not None:
        yield existing
        return
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # loss closures may hold real targets
    swapped: list[tuple[nn.Module, str, str, Any]] = []
    fakes: dict[int, Any] = {}
    try:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(fake_mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
                swapped.append((mod, "_parameters", name, p))
                mod._parameters[name] = fakes[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) not in fakes:
                    fakes[id(b)] = fake_mode.from_tensor(b)
                swapped.append((mod, "_buffers", name, b))
                mod._buffers[name] = fakes[id(b)]
        yield fake_mode
    finally:
        for mod, where, name, original in reversed(swapped):
            getattr(mod, where)[name] = original


# -- summary -----------------------------------------------------------------------------------


def _categorise(tracker: MemoryTracker) -> list[str]:
    """Each storage's category, decided once the step is over."""
    fwd_end = tracker.forward_end.get("event")  # type: ignore[attr-defined]
    saved = set(tracker.forward_end.get("live", ()))  # type: ignore[attr-defined]
    kinds = []
    for i, rec in enumerate(tracker.records):
        if rec.kind is not None:
            kinds.append(rec.kind)
        elif rec.late:  # made outside the tracker's view: pre-existing if it outlives the step
            kinds.append(INPUT if rec.died is None else "temporaries")
        elif i in tracker.grad_records:  # type: ignore[attr-defined]
            kinds.append("gradients")
        elif i in tracker.opt_records:  # type: ignore[attr-defined]
            kinds.append("optimizer_state")
        elif fwd_end is not None and rec.phase == "forward" and i in saved:
            kinds.append("activations")
        else:
            kinds.append("temporaries")
    return kinds


def _summarise(tracker: MemoryTracker, workload: Workload, mode: str, times: list[float], cuda: dict) -> Measurement:
    kinds = _categorise(tracker)
    live = {c: 0 for c in CATEGORIES}
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    peak, peak_index, peak_split = -1, 0, dict(live)
    phase_starts: dict[str, int] = {}
    fwd_end_split = dict(live)
    fwd_end = tracker.forward_end.get("event")  # type: ignore[attr-defined]
    # Late-seen storages that outlive the step existed before it (a target tensor held by the loss
    # closure): count them from the first event, like parameters, not from their first use.
    preexisting = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
    for i in preexisting:
        live[kinds[i]] += tracker.records[i].nbytes
    for i, ((idx, delta), phase) in enumerate(zip(tracker.events, tracker.event_phase)):
        if not (idx in preexisting and delta > 0 and i == tracker.records[idx].born):
            live[kinds[idx]] += delta
        for c in CATEGORIES:
            series[c].append(live[c])
        phase_starts.setdefault(phase, i)
        total = sum(live.values())
        if total > peak:
            peak, peak_index, peak_split = total, i, dict(live)
        if fwd_end is not None and i == fwd_end - 1:
            fwd_end_split = dict(live)

    saved_by_module: dict[str, int] = {}
    saved_by_module_op: dict[tuple[str, str], int] = {}
    saved_by_op: dict[str, int] = {}
    for rec, kind in zip(tracker.records, kinds):
        if kind != "activations":
            continue
        saved_by_module[rec.module] = saved_by_module.get(rec.module, 0) + rec.nbytes
        saved_by_module_op[(rec.module, rec.op)] = saved_by_module_op.get((rec.module, rec.op), 0) + rec.nbytes
        saved_by_op[rec.op] = saved_by_op.get(rec.op, 0) + rec.nbytes
    saved_total = sum(saved_by_module.values())

    modules = tuple(_module_rows(workload.model, tracker, saved_by_module))
    op_counts: dict[str, int] = {}
    for (_, op), n in tracker.op_calls.items():
        op_counts[op] = op_counts.get(op, 0) + n
    flop_counts = tracker.flop_counts  # type: ignore[attr-defined]
    ops = tuple(
        OpStats(op=op, count=op_counts.get(op, 0), saved_bytes=saved_by_op.get(op, 0), flops=flop_counts.get(op, 0))
        for op in sorted(set(op_counts) | set(saved_by_op) | set(flop_counts), key=lambda o: (-saved_by_op.get(o, 0), o))
    )
    module_ops = tuple(
        (m, op, n, saved_by_module_op.get((m, op), 0))
        for (m, op), n in sorted(set(tracker.op_calls.items()) | {(k, 0) for k in saved_by_module_op if k not in tracker.op_calls})
    )
    phases = tracker.event_phase
    return Measurement(
        mode=mode,
        device=str(workload.device),
        peak_bytes=max(peak, 0),
        peak_split=MemorySplit(**peak_split),
        peak_index=peak_index,
        peak_phase=phases[peak_index] if phases else "",
        saved_bytes=saved_total,
        end_of_forward=MemorySplit(**fwd_end_split),
        modules=modules,
        ops=ops,
        module_ops=module_ops,
        timeline=Timeline(phase=tuple(phases), by_category={c: tuple(v) for c, v in series.items()}, phase_starts=phase_starts),
        step_seconds=statistics.median(times) if times else None,
        step_seconds_all=tuple(times),
        flops=sum(flop_counts.values()),
        cuda_peak_bytes=cuda.get("peak"),
        cuda_baseline_bytes=cuda.get("baseline"),
    )


def _module_rows(model: nn.Module, tracker: MemoryTracker, saved_own: dict[str, int]) -> Iterator[ModuleStats]:
    named = list(model.named_modules())
    rolled: dict[str, int] = {name: 0 for name, _ in named}
    for name, nbytes in saved_own.items():
        # add to the module and every ancestor
        parts = name.split(".") if name else []
        rolled[""] = rolled.get("", 0) + nbytes
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in rolled:
                rolled[prefix] += nbytes
    for name, mod in named:
        own = list(mod._parameters.values())
        trainable = sum(p.numel() for p in own if p is not None and p.requires_grad)
        frozen = sum(p.numel() for p in own if p is not None and not p.requires_grad)
        yield ModuleStats(
            name=name,
            type_name=type(mod).__name__,
            depth=0 if name == "" else name.count(".") + 1,
            output_shape=tracker.module_output_shapes.get(name),
            trainable_params=trainable,
            frozen_params=frozen,
            saved_bytes_own=saved_own.get(name, 0),
            saved_bytes=rolled.get(name, 0),
            calls=tracker.module_calls.get(name, 0),
            is_leaf=not any(True for _ in mod.children()),
        )
