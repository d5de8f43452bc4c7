"""The step runner: training steps under the tracker (first, tracked, timed), the optimizer's
backup, the saved-tensor hooks, and the errors a failing step raises."""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from ..errors import Cancelled, MemsaveError, StepError, WorkloadError
from ..workload import Workload, iter_tensors, map_tensors, output_parts
from . import fake_compat
from .common import clear_grads, single_tensor_default
from .fake_model import _fake_twin, _is_fake
from .optimizer_state import make_state_on_zero_grads, makes_state_without_a_step
from .host import host_memory, host_scope
from .tracker import INPUT, PARAMETER, MemoryTracker
from .training_step import training_step


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

    def run(
        self,
        make_batch: Callable[[], Any],
        on_forward_end: Callable[[Any, Any], None] | None = None,
        saved_hook: Callable[[torch.Tensor], None] | None = None,
    ) -> list[Any]:
        """One training step: k micro-steps (forward, loss / k, backward), then the optimizer; the
        last micro-step's output lives as the workload's ``loop`` says (``output_dropped``).

        Returns the batches it used (the caller drops them)."""
        wl = self.workload
        held: list[Any] = []  # the micro-step's batch, alive until the next one is made, as in a loop

        def next_batch(last: bool) -> Any:
            batch = make_batch()
            held[:] = [batch]
            self._batch_grad = any(t.requires_grad for t in iter_tensors(batch))
            self.make_optimizer()
            if self.tracker is not None:
                self.tracker.count_calls = last
            return batch

        def on_phase(phase: str, last: bool) -> None:
            self.set_phase(phase)

        def context(phase: str, last: bool) -> Any:
            if phase == "forward" and last and saved_hook is not None:
                return torch.autograd.graph.saved_tensors_hooks(_packer(saved_hook, self.tracker), _unpack)
            if phase == "optimizer" and self.fake:
                return fake_compat.optimizer_numbers()
            return contextlib.nullcontext()

        left = training_step(
            wl,
            next_batch,
            lambda: self.optimizer,
            runner="engine",
            on_phase=on_phase,
            context=context,
            on_forward_end=on_forward_end,
        )
        del left  # the loss lives to the end of the step in every loop (a trainer logs it)
        return held

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.workload.model.parameters() if p.grad is not None]

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [t for s in self.optimizer.state.values() for t in iter_tensors(s)]


def _packer(
    note: Callable[[torch.Tensor], None], tracker: MemoryTracker | None
) -> Callable[[torch.Tensor], torch.Tensor]:
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
        for g, settings in zip(opt.param_groups, self.groups):
            g.update(settings)


def _run(
    workload: Workload,
    *,
    fake_mode,
    flops: bool,
    cancel_event,
    steady_state: bool,
    repeats: int,
    first_step_peak: bool = False,
    restore: Callable[[], None] | None = None,
    after_tracked: Callable[..., None] | None = None,
):
    """The steps of one measurement: the optimizer's state (made cheaply, or by a whole first
    step), the tracked step, (timed steps).

    Steady state without ``first_step_peak``: the optimizer makes its state on zero gradients
    (``optimizer_state.py``), then one step is tracked. Were the parameters that received a
    gradient in that step not the ones given state, the measurement is run again the old way
    (``restore`` puts the model back first): a whole first step under a light tracker.
    ``after_tracked(tracker, cuda, first_peak, parts)``: called once, after the tracked step that
    counts and before the timed steps (only when there are timed steps)."""
    if steady_state and not first_step_peak:
        result = _run_once(
            workload,
            fake_mode=fake_mode,
            flops=flops,
            cancel_event=cancel_event,
            warm_up="state",
            repeats=repeats,
            after_tracked=after_tracked,
        )
        if result is not None:
            return result
        if restore is not None:
            restore()
    return _run_once(
        workload,
        fake_mode=fake_mode,
        flops=flops,
        cancel_event=cancel_event,
        warm_up="step" if steady_state else None,
        repeats=repeats,
        after_tracked=after_tracked,
    )


def _run_once(
    workload: Workload,
    *,
    fake_mode,
    flops: bool,
    cancel_event,
    warm_up: str | None,
    repeats: int,
    after_tracked: Callable[..., None] | None = None,
):
    """``warm_up``: None (first step), ``"step"`` (a whole first step) or ``"state"`` (state on
    zero gradients; None is returned when that proved unlike a first step)."""
    model = workload.model
    for p in model.parameters():
        p.grad = None
    step = _Step(workload, cancel_event)
    step.fake = fake_mode is not None
    tracker: MemoryTracker | None = None
    received: set[int] | None = None
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            make_batch = functools.partial(_make_batch, workload, fake_mode, model)
            first_peak = None
            given: list[torch.Tensor] = []
            if warm_up == "state":
                made = _make_state(step)
                if made is None:
                    warm_up = "step"  # an optimizer not trusted to make its state without a step
                else:
                    given, received = made, set()
            if warm_up == "step":
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
            with _noting_gradients(given, received), host_scope() as host:
                tracker, cuda, parts = _tracked_step(step, tracker, make_batch, fake_mode)
            tracker.host_memory = host_memory(host)  # type: ignore[attr-defined,union-attr]  # offloaded: Measurement.host
            if received is not None and received != {id(p) for p in given}:
                return None  # some parameter given state received no gradient (or the reverse)
            if warm_up is None:
                first_peak = _peak_of(tracker)
            step.tracker = None
            if after_tracked is not None and repeats:
                after_tracked(tracker, cuda, first_peak, parts)
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


def _make_state(step: _Step) -> list[torch.Tensor] | None:
    """The optimizer's state made as its first step would make it, out of any tracker's view, for
    the parameters that require grad (assumed to be those the step gives a gradient; checked after
    the tracked step). Grads are then cleared as ``zero_grad(set_to_none=...)`` leaves them.
    Returns those parameters, or None for an optimizer this cannot be trusted with."""
    model = step.workload.model
    trainable: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return []  # nothing to make state for; the tracked step says what else is wrong
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in trainable):
        return None
    step.make_optimizer()
    optimizer = step.optimizer
    if not makes_state_without_a_step(optimizer):
        return None
    if optimizer is not None:
        make_state_on_zero_grads(optimizer, trainable, fake_compat.optimizer_numbers() if step.fake else None)
    elif not step.workload.set_to_none:  # no state to make: only the zeroed grads a step leaves
        for p in trainable:
            p.grad = torch.zeros_like(p)
    step.zero_grad()
    return trainable


@contextlib.contextmanager
def _noting_gradients(params: list[torch.Tensor], received: set[int] | None):
    """Note (in ``received``) each of ``params`` whose gradient is accumulated."""
    if received is None:
        yield
        return
    handles = [p.register_post_accumulate_grad_hook(lambda t: received.add(id(t))) for p in params]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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
            parts.append((name, {r for t in tensors if (r := tracker.record_of(t)) is not None}))

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
    head = f"{phase_text}{where}: {kind}: "
    room = max(60, 200 - len(head))  # torch's messages quote the user's values (a device string, a shape) whole
    if len(first_line) > room:
        first_line = first_line[: room - 3] + "..."
    return StepError(head + first_line, phase=phase, module=module, cause=exc)
