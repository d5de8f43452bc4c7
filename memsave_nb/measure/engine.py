"""``measure()``: run one training step for real or with fake tensors, under the tracker.

The step is forward, loss, backward and (when the workload has one) the optimizer's first step.
Everything it changes in the model (weights, batch-norm statistics, grads) is put back afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import statistics
import threading
import time
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import Cancelled, MemsaveError, StepError, WorkloadError
from ..model_state import ModelSnapshot
from ..workload import Workload, iter_tensors, map_tensors, output_parts
from . import fake_compat
from .result import CATEGORIES, Measurement, MemorySplit, ModuleStats, OpStats, Timeline
from .tracker import INPUT, PARAMETER, MemoryTracker

MODES = ("real", "fake")

# One lock per model object: two threads (or two Sessions) measuring the same model take turns.
_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The re-entrant lock ``measure()`` holds on ``model`` while it runs.

    Code that changes the model for a measurement (``Plan.apply``, a Session) can hold it around
    its changes too, so that a concurrent measurement of the same model waits instead of seeing
    a half-changed model.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def measure(
    workload: Workload,
    mode: str = "real",
    *,
    repeats: int = 3,
    flops: bool = True,
    cancel_event: threading.Event | None = None,
    steady_state: bool = True,
) -> Measurement:
    """Measure one training step of ``workload``: peak and its split, saved activations and
    outputs per module and op, a live-bytes timeline, FLOPs and (real mode) the median step time.

    ``steady_state=True`` (default) measures the step as training's step 2 and later: the
    optimizer's state exists from the start (made by the optimizer itself in a first, lightly
    tracked step whose peak is ``first_step_peak_bytes``), grads cleared per the workload's
    ``set_to_none``. ``steady_state=False`` measures the first step.

    ``mode="fake"`` runs the same steps under ``FakeTensorMode``: shapes and bytes without memory
    or compute, for models too large for this machine. The model is left as it was.
    """
    if mode not in MODES:
        raise WorkloadError(f"unknown mode {mode!r}; choose 'real' or 'fake'")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise WorkloadError(f"repeats must be a whole number >= 0, got {repeats!r}")
    if not isinstance(steady_state, bool):
        raise WorkloadError(f"steady_state must be True or False, got {steady_state!r}")
    if _is_compiled(workload.model):
        # Inside a compiled graph allocations bypass Python dispatch: count them from the
        # profiler's memory events instead (no per-module rows there).
        if mode == "fake":
            raise WorkloadError("a torch.compile'd model cannot be measured in fake mode; measure it in real mode")
        from .compiled import measure_compiled

        return measure_compiled(workload, mode=mode, repeats=repeats, cancel_event=cancel_event, steady_state=steady_state)
    model = workload.model
    with model_lock(model):  # a concurrent fake-mode run swaps the parameters: check inside the lock
        if mode == "real" and _has_fake_tensors(model):
            raise WorkloadError(
                f"the model of {workload.name!r} holds fake or meta tensors (built under FakeTensorMode or on the meta device): measure it with mode='fake'"
            )
        snapshot = ModelSnapshot.capture(model, copy_values=(mode == "real"))
        leaves = _user_leaf_grads(workload)
        try:
            if mode == "fake":
                with _fake_model(model, workload.device) as fake_mode, fake_compat.same_path_as_real(workload):
                    result = _run(workload, fake_mode=fake_mode, flops=flops, cancel_event=cancel_event,
                                  steady_state=steady_state, repeats=0)
            else:
                result = _run(workload, fake_mode=None, flops=flops, cancel_event=cancel_event,
                              steady_state=steady_state, repeats=repeats)
        finally:
            snapshot.restore(model)
            for t, g in leaves:
                t.grad = g
    tracker, cuda, times, first_peak, parts, optimizer_kind = result
    m = _summarise(tracker, workload, mode, times, cuda, first_step_peak=first_peak, steady_state=steady_state,
                   output_parts=parts)
    if mode == "fake" and optimizer_kind is not None:
        m = dataclasses.replace(m, notes=m.notes + (foreach_note(optimizer_kind),))
    return m


def single_tensor_default(optimizer: Any) -> str | None:
    """The optimizer's class name when it was left to pick its implementation (``foreach=None``,
    not fused) over CPU parameters: torch then runs its single-tensor loop, while on a CUDA GPU the
    same constructor picks the foreach step, whose temporaries are larger. None otherwise."""
    if not isinstance(optimizer, torch.optim.Optimizer) or "foreach" not in optimizer.defaults:
        return None
    groups = optimizer.param_groups
    if not any(g.get("foreach") is None and not g.get("fused") for g in groups):
        return None
    if not all(p.device.type == "cpu" for g in groups for p in g["params"]):
        return None
    return type(optimizer).__name__


def foreach_note(name: str) -> str:
    return (
        f"{name} ran its single-tensor step (fake mode on the CPU); on a CUDA GPU torch's default is its foreach "
        "step, whose temporaries during the optimizer step are larger (up to about the size of the trainable "
        "parameters): to size for a GPU, measure with the optimizer knob 'adamw_foreach' (or foreach=True)"
    )


def _is_compiled(model: nn.Module) -> bool:
    """A ``torch.compile``'d module (an ``OptimizedModule`` wrapper)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, OptimizedModule)


def _user_leaf_grads(workload: Workload) -> list[tuple[torch.Tensor, Any]]:
    """Leaf tensors of a given batch (not a factory) that require grad, with their ``.grad``
    (cleared for the run, given back after it): the step must not leave a gradient on the
    user's own tensors, nor add to one."""
    raw = workload.batch
    if callable(raw) and not isinstance(raw, nn.Module):
        return []
    leaves = [(t, t.grad) for t in iter_tensors(raw) if t.requires_grad and t.grad_fn is None]
    for t, _ in leaves:
        t.grad = None  # else backward would accumulate into the user's own grad
    return leaves


# -- the step ----------------------------------------------------------------------------------


def clear_grads(model: nn.Module, set_to_none: bool) -> None:
    """What ``optimizer.zero_grad(set_to_none=...)`` does between steps: drop the grads, or zero
    them in place (their storages stay allocated)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_()
            p.grad.zero_()


class _Step:
    """Training steps with phase bookkeeping, shared by tracked and timed runs.

    One ``_Step`` is one training loop: its optimizer is made once and keeps its state from step
    to step; grads are cleared between steps as ``zero_grad(set_to_none=...)`` does.
    """

    def __init__(self, workload: Workload, cancel_event: threading.Event | None):
        self.workload = workload
        self.tracker: MemoryTracker | None = None
        self.cancel_event = cancel_event
        self.phase = "setup"  # where an error happened: setup, forward, loss, backward, optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.backup: _OptimizerBackup | None = None
        self.made_optimizer = False
        self.fake = False  # under FakeTensorMode: the optimizer's .item() reads answer 1 (fake_compat)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.tracker is not None:
            # the loss is computed in the forward phase of the timeline; only errors name it apart
            self.tracker.phase = "forward" if phase == "loss" else phase
            # no module runs between phases; a checkpointed region's recomputation stops early in
            # backward (its forward hooks never close), so its modules would stay on the stack and
            # later ops outside any module (a loss, the optimizer) would be charged to them
            self.tracker.module_stack.clear()
        if self.cancel_event is not None and self.cancel_event.is_set():
            raise Cancelled("run cancelled")

    def make_optimizer(self) -> None:
        wl = self.workload
        if self.made_optimizer:
            return
        if not any(p.requires_grad for p in wl.model.parameters()) and not self._batch_requires_grad():
            raise WorkloadError(
                "nothing to differentiate: every parameter is frozen and the input does not require grad"
            )
        self.made_optimizer = True
        optimizer = wl.make_optimizer()
        if optimizer is not None:
            model_params = {id(p) for p in wl.model.parameters()}
            foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
            if foreign:
                raise WorkloadError(
                    f"the optimizer factory returned an optimizer over {len(foreign)} tensor(s) that are not the model's "
                    "parameters; build the optimizer from the parameters the factory is given"
                )
            # the backup's copies of state the optimizer made at construction (bf16_master's fp32
            # masters) are the engine's own memory, not the step's: hidden from the tracker
            tracker = self.tracker
            if tracker is not None:
                tracker.ignore = True
            try:
                self.backup = _OptimizerBackup(optimizer)
            finally:
                if tracker is not None:
                    tracker.ignore = False
        self.optimizer = optimizer

    def _batch_requires_grad(self) -> bool:
        return bool(getattr(self, "_batch_grad", False))

    def zero_grad(self) -> None:
        """Between steps, as a training loop clears grads."""
        clear_grads(self.workload.model, self.workload.set_to_none)

    def run(self, make_batch: Callable[[], Any], on_forward_end: Callable[[Any, Any], None] | None = None,
            saved_hook: Callable[[torch.Tensor], None] | None = None) -> list[Any]:
        """One training step: k micro-steps (forward, loss / k, backward), then the optimizer.

        Returns the batches it used (the caller drops them)."""
        wl = self.workload
        k = wl.accumulation_steps
        batches = []
        for micro in range(k):
            batch = make_batch()
            batches = [batch]  # a micro-step's batch dies with the micro-step, as in a loop
            self._batch_grad = any(t.requires_grad for t in iter_tensors(batch))
            self.make_optimizer()
            last = micro == k - 1
            if self.tracker is not None:
                self.tracker.count_calls = last
            self.set_phase("forward")
            if saved_hook is not None and last:
                with torch.autograd.graph.saved_tensors_hooks(_packer(saved_hook, self.tracker), _unpack):
                    output = wl.forward(batch)
                    self.set_phase("loss")
                    loss = wl.compute_loss(output)
            else:
                output = wl.forward(batch)
                self.set_phase("loss")
                loss = wl.compute_loss(output)
            if not loss.requires_grad:
                raise WorkloadError("the loss does not depend on anything that requires grad")
            if k > 1:
                loss = loss / k
            if on_forward_end is not None and last:
                on_forward_end(output, loss)
            self.set_phase("backward")
            loss.backward()
            if not last:
                del output, loss
        if self.optimizer is not None:
            self.set_phase("optimizer")
            with fake_compat.optimizer_numbers() if self.fake else contextlib.nullcontext():
                self.optimizer.step()
        self.set_phase("done")
        del output, loss
        return batches

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.workload.model.parameters() if p.grad is not None]

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [t for s in self.optimizer.state.values() for t in iter_tensors(s)]


def _packer(note: Callable[[torch.Tensor], None], tracker: MemoryTracker | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that notes what autograd saves and keeps it as autograd would.

    A tensor made by autograd is kept detached: the same storage, and no reference cycle through a
    saved output's ``grad_fn`` (keeping ``t`` itself would hold a discarded branch alive until
    garbage collection). A leaf is kept as it is (no cycle; under fake mode detaching a real
    leaf would make a fake copy). The detach is the engine's own op: the tracker ignores it.
    """

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        if t.grad_fn is None:
            return t
        if tracker is None:
            return t.detach()
        tracker.ignore = True
        try:
            return t.detach()
        finally:
            tracker.ignore = False

    return pack


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _OptimizerBackup:
    """What a step changes in an optimizer (state entries and values, group settings, attributes),
    put back on ``restore()``: an optimizer the user already holds is left as it was."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.state_obj = optimizer.state
        self.entries = {p: (s, dict(s)) for p, s in optimizer.state.items()}
        self.values = {
            (id(p), k): v.detach().clone()
            for p, s in optimizer.state.items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and not _is_fake(v) and v.device.type != "meta"
        }
        self.groups = [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.attrs = dict(vars(optimizer))

    def restore(self) -> None:
        opt = self.optimizer
        for key in list(vars(opt)):
            if key not in self.attrs:
                delattr(opt, key)
        for key, value in self.attrs.items():
            setattr(opt, key, value)
        state = self.state_obj
        for p in list(state):
            if p not in self.entries:
                del state[p]
        with torch.no_grad():
            for p, (obj, items) in self.entries.items():
                obj.clear()
                obj.update(items)
                state[p] = obj
                for k, v in items.items():
                    saved = self.values.get((id(p), k))
                    if saved is not None and isinstance(v, torch.Tensor) and v.shape == saved.shape:
                        v.copy_(saved)
        for g, saved in zip(opt.param_groups, self.groups):
            g.update(saved)


def _run(workload: Workload, *, fake_mode, flops: bool, cancel_event, steady_state: bool, repeats: int):
    """The steps of one measurement: (first step,) the tracked step, (timed steps)."""
    model = workload.model
    for p in model.parameters():
        p.grad = None
    step = _Step(workload, cancel_event)
    step.fake = fake_mode is not None
    tracker: MemoryTracker | None = None
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            make_batch = functools.partial(_make_batch, workload, fake_mode, model)
            first_peak = None
            if steady_state:
                # Step 1, as training's first step: the optimizer makes its own state.
                first = MemoryTracker(model)
                _register_model(first, model)
                step.tracker = first
                with first:
                    step.run(make_batch)
                step.tracker = None
                first_peak = _peak_of(first)
                del first
                step.zero_grad()
            tracker = MemoryTracker(model, count_flops=flops)
            step.tracker = tracker
            tracker, cuda, parts = _tracked_step(step, tracker, make_batch, fake_mode)
            if first_peak is None:
                first_peak = _peak_of(tracker)
            step.tracker = None
            times = []
            for _ in range(repeats):
                step.zero_grad()
                times.append(_timed_step(step, make_batch))
    except (MemsaveError, KeyboardInterrupt):
        raise
    except torch.OutOfMemoryError as exc:
        raise _step_error(exc, step.phase, step.tracker or tracker, "out of memory") from exc
    except Exception as exc:  # noqa: BLE001 - reworded with phase and module, cause kept
        raise _step_error(exc, step.phase, step.tracker or tracker) from exc
    finally:
        if step.backup is not None:
            step.backup.restore()
        for p in model.parameters():
            p.grad = None
    return tracker, cuda, times, first_peak, parts, single_tensor_default(step.optimizer)


def _register_model(tracker: MemoryTracker, model: nn.Module) -> None:
    tracker.register_existing(model.parameters(), PARAMETER)
    tracker.register_existing((b for b in model.buffers() if b is not None), PARAMETER)


def _peak_of(tracker: MemoryTracker) -> int:
    live = peak = 0
    for _, delta in tracker.events:
        live += delta
        peak = max(peak, live)
    return peak


def _tracked_step(step: _Step, tracker: MemoryTracker, make_batch, fake_mode):
    workload = step.workload
    model = workload.model
    _register_model(tracker, model)
    # state left by step 1 (or a user's optimizer) and zeroed grads exist before this step
    tracker.register_existing(step.optimizer_state(), "optimizer_state")
    tracker.register_existing(step.grads(), "gradients")
    cuda: dict[str, int] = {}
    on_cuda = torch.device(workload.device).type == "cuda" and fake_mode is None
    end_of_forward: dict[str, Any] = {}
    saved_records: set[int | None] = set()
    parts: list[tuple[str, set[int]]] = []

    def note_saved(t: torch.Tensor) -> None:
        saved_records.add(tracker.record_of(t))

    def mark_forward_end(output: Any, loss: torch.Tensor) -> None:
        end_of_forward["event"] = len(tracker.events)
        end_of_forward["live"] = tracker.live_records()
        for name, tensors in output_parts(output) + [("loss", [loss])]:
            parts.append((name, {tracker.record_of(t) for t in tensors} - {None}))

    batches: list[Any] = []
    state: dict[str, Any] = {}
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda["baseline"] = torch.cuda.memory_allocated()

    def tracked_batch() -> Any:
        # the batch exists before the step in a training loop: made out of the tracker's view
        tracker.ignore = True
        try:
            batch = make_batch()
        finally:
            tracker.ignore = False
        tracker.register_existing(iter_tensors(batch), INPUT)
        return batch

    with tracker:
        batches = step.run(tracked_batch, mark_forward_end, note_saved)
        state["grads"] = {tracker.record_of(g) for g in step.grads()}
        # an input that requires grad keeps its .grad too: a gradient, not a temporary
        state["grads"] |= {tracker.record_of(t.grad) for b in batches for t in iter_tensors(b) if t.grad is not None}
        state["opt"] = {tracker.record_of(t) for t in step.optimizer_state()}
        if on_cuda:
            torch.cuda.synchronize()
            cuda["peak"] = torch.cuda.max_memory_allocated()
    del batches  # after the tracker closed: a converted (fake) batch dying is not part of the step
    tracker.module_stack.clear()
    tracker.grad_records = state["grads"] - {None}  # type: ignore[attr-defined]
    tracker.opt_records = state["opt"] - {None}  # type: ignore[attr-defined]
    tracker.forward_end = end_of_forward  # type: ignore[attr-defined]
    tracker.saved_records = saved_records - {None}  # type: ignore[attr-defined]
    out_records: set[int] = set()
    for _, recs in parts:
        out_records |= recs
    tracker.output_records = out_records  # type: ignore[attr-defined]
    return tracker, cuda, parts


def _timed_step(step: _Step, make_batch) -> float:
    on_cuda = torch.device(step.workload.device).type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    batches = step.run(make_batch)
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del batches
    return elapsed


def _make_batch(workload: Workload, fake_mode, model: nn.Module) -> Any:
    if fake_mode is None:
        return workload.make_batch()
    # Under fake mode: a factory builds fake tensors directly; real tensors are converted, and
    # meta tensors become fake tensors on the workload's device.
    raw = workload.batch() if callable(workload.batch) else workload.batch
    device = torch.device(workload.device)
    converted = map_tensors(raw, lambda t: t if _is_fake(t) else _fake_twin(fake_mode, t, device))
    return workload.replace(batch=converted).make_batch()


def _fake_twin(fake_mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor for ``t``; a meta tensor presents as the workload's device (as if built there
    under ``FakeTensorMode``)."""
    if t.device.type == "meta" and device.type != "meta":
        with fake_mode:
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return twin.requires_grad_(t.requires_grad) if t.requires_grad and t.is_leaf else twin
    return fake_mode.from_tensor(t)


def _step_error(exc: BaseException, phase: str, tracker: MemoryTracker | None, what: str | None = None) -> StepError:
    in_module = tracker is not None and bool(tracker.module_stack)
    module = tracker.current_module() if tracker is not None else ""
    model = tracker._model if tracker is not None else None
    if phase == "loss" and not in_module:
        where, phase_text = "", "step failed in the loss"
    else:
        phase_text = f"step failed during {phase}"
        if not in_module:
            where = " outside any module"
        else:
            where = f" in module {module!r}" if module else " in module <root>"
            if model is not None:
                try:
                    where += f" ({type(model.get_submodule(module)).__name__})"
                except AttributeError:
                    pass
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    kind = what or type(exc).__name__
    return StepError(f"{phase_text}{where}: {kind}: {first_line}", phase=phase, module=module, cause=exc)


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
def _fake_model(model: nn.Module, device: str = "cpu") -> Iterator[Any]:
    """Swap parameters and buffers for fake twins (same shapes, dtypes, devices); swap back on exit.

    A model built under ``FakeTensorMode`` already has fake tensors: its own mode is reused.
    Tensors on the meta device (``with torch.device("meta")``, ``init_empty_weights``) get twins
    on the workload's device, as if the model had been built there under ``FakeTensorMode``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    existing = next((t.fake_mode for t in list(model.parameters()) + list(model.buffers()) if _is_fake(t)), None)
    if existing is not None:
        yield existing
        return
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # loss closures may hold real targets
    target = torch.device(device)
    swapped: list[tuple[nn.Module, str, str, Any]] = []
    fakes: dict[int, Any] = {}
    try:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in fakes:
                    fakes[id(p)] = nn.Parameter(_fake_twin(fake_mode, p.detach(), target), requires_grad=p.requires_grad)
                swapped.append((mod, "_parameters", name, p))
                mod._parameters[name] = fakes[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                if id(b) not in fakes:
                    fakes[id(b)] = _fake_twin(fake_mode, b.detach(), target)
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
    outputs = getattr(tracker, "output_records", set())
    saved_for_backward = getattr(tracker, "saved_records", set())
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
            # kept to the end of forward: by autograd for backward, or only by the step's outputs
            # (logits, KV cache, the loss) when the output reaches it and autograd did not save it
            kinds.append("outputs" if i in outputs and i not in saved_for_backward else "activations")
        else:
            kinds.append("temporaries")
    return kinds


def _summarise(tracker: MemoryTracker, workload: Workload, mode: str, times: list[float], cuda: dict, *,
               first_step_peak: int | None = None, steady_state: bool = False,
               output_parts: list[tuple[str, set[int]]] | None = None) -> Measurement:
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
    output_by_module: dict[str, int] = {}
    for rec, kind in zip(tracker.records, kinds):
        if kind == "outputs":
            output_by_module[rec.module] = output_by_module.get(rec.module, 0) + rec.nbytes
        if kind != "activations":
            continue
        saved_by_module[rec.module] = saved_by_module.get(rec.module, 0) + rec.nbytes
        saved_by_module_op[(rec.module, rec.op)] = saved_by_module_op.get((rec.module, rec.op), 0) + rec.nbytes
        saved_by_op[rec.op] = saved_by_op.get(rec.op, 0) + rec.nbytes
    saved_total = sum(saved_by_module.values())

    output_total = sum(output_by_module.values())
    parts = _output_part_bytes(output_parts or [], tracker, kinds)
    modules = tuple(_module_rows(workload.model, tracker, saved_by_module, output_by_module))
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
        output_bytes=output_total,
        output_parts=parts,
        first_step_peak_bytes=first_step_peak,
        steady_state=steady_state,
        advice=advice_for(parts, saved_total + output_total, max(peak, 0)) + autocast_advice(workload, ops, saved_total),
    )


def autocast_advice(workload: Workload, ops: tuple[OpStats, ...], saved_bytes: int) -> tuple[str, ...]:
    """Under ``torch.autocast`` each matmul saves the low-precision copies of its operands that
    autocast made (``aten._to_copy``), weights included: a model of large weights and small batches
    can keep more than in fp32. One hint when those copies are a large share of what is saved."""
    if getattr(workload, "autocast_dtype", None) is None or saved_bytes <= 0:
        return ()
    casts = sum(o.saved_bytes for o in ops if o.op == "aten._to_copy")
    if casts < ADVICE_SHARE * saved_bytes:
        return ()
    return (
        f"{_mib(casts)} ({casts / saved_bytes:.0%} of the saved bytes) are autocast's low-precision copies of weights "
        "and inputs (aten._to_copy), kept for backward; parameters held in bf16 (precision 'bf16' or 'bf16_master') "
        "need no weight copies",
    )


def _output_part_bytes(parts: list[tuple[str, set[int]]], tracker: MemoryTracker, kinds: list[str]) -> tuple[tuple[str, int], ...]:
    """Bytes each named part of the output keeps alive beyond what autograd saved (each storage
    counted once, in the first part that reaches it)."""
    seen: set[int] = set()
    out = []
    for name, records in parts:
        mine = {i for i in records if kinds[i] == "outputs"} - seen
        seen |= mine
        nbytes = sum(tracker.records[i].nbytes for i in mine)
        if nbytes:
            out.append((name, nbytes))
    return tuple(out)


# A part of the output gets a hint when it holds at least this share of what the step keeps at the
# end of forward (saved for backward + outputs); a KV cache from 1% on (turning it off costs nothing
# in training).
ADVICE_SHARE = 0.10
ADVICE_SHARE_CACHE = 0.01
_CACHE_PARTS = ("past_key_values", "present_key_values", "mems", "cache")


def advice_for(parts: tuple[tuple[str, int], ...], kept_bytes: int, peak_bytes: int) -> tuple[str, ...]:
    """One-line hints for outputs that keep much memory to the end of the step, and what frees them.

    ``kept_bytes``: saved for backward plus outputs at the end of forward; a part gets a hint when
    it holds at least ``ADVICE_SHARE`` of it."""
    hints = []
    for name, nbytes in parts:
        share_needed = ADVICE_SHARE_CACHE if name in _CACHE_PARTS else ADVICE_SHARE
        if peak_bytes <= 0 or kept_bytes <= 0 or nbytes < share_needed * kept_bytes:
            continue
        size = _mib(nbytes)
        share = f"{nbytes / peak_bytes:.0%} of the peak"
        if name in _CACHE_PARTS:
            hints.append(f"use_cache=False frees the KV cache ({size}, {share}): training does not need it")
        elif name == "logits":
            hints.append(
                f"the logits stay alive to the end of the step ({size}, {share}): keep only the loss "
                "(loss = model(**batch).loss), compute the loss inside the model or use a chunked cross-entropy"
            )
        elif name != "loss":
            hints.append(f"the output {name!r} stays alive to the end of the step ({size}, {share}): drop it after the loss if training does not need it")
    return tuple(hints)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _module_rows(model: nn.Module, tracker: MemoryTracker, saved_own: dict[str, int],
                 output_own: dict[str, int] | None = None) -> Iterator[ModuleStats]:
    named = list(model.named_modules())
    output_own = output_own or {}
    rolled = _roll_up(named, saved_own)
    rolled_out = _roll_up(named, output_own)
    for name, mod in named:
        own = list(mod._parameters.values())
        trainable = sum(p.numel() for p in own if p is not None and p.requires_grad)
        frozen = sum(p.numel() for p in own if p is not None and not p.requires_grad)
        distinct = list(mod.parameters())  # deduplicated: a tied weight once
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
            output_bytes_own=output_own.get(name, 0),
            output_bytes=rolled_out.get(name, 0),
            trainable_params_subtree=sum(p.numel() for p in distinct if p.requires_grad),
            frozen_params_subtree=sum(p.numel() for p in distinct if not p.requires_grad),
        )


def _roll_up(named: list[tuple[str, nn.Module]], own: dict[str, int]) -> dict[str, int]:
    """Bytes per module over its subtree: each module's own bytes added to it and every ancestor."""
    rolled: dict[str, int] = {name: 0 for name, _ in named}
    for name, nbytes in own.items():
        parts = name.split(".") if name else []
        rolled[""] = rolled.get("", 0) + nbytes
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in rolled:
                rolled[prefix] += nbytes
    return rolled
