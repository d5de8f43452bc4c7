"""Measure code that runs a training step itself (a notebook cell, a function).

``measure()`` drives the step from a Workload. Here the code does forward, loss, backward and
maybe an optimizer step on its own; :func:`measure_callable` runs it once, for real, under the
same tracker, and finds the phases as they happen:

- ``setup`` until the first module's forward (storages born here count as inputs),
- ``forward`` until the first ``torch.autograd.backward``/``grad`` call on this thread (the
  storages alive then are the saved activations),
- ``backward``, then ``optimizer`` from the first ``Optimizer.step``.

What is alive at the end of forward is split as :func:`~memsave_nb.measure.measure` splits it:
*activations* are what autograd saved for backward (noted by a ``saved_tensors_hooks`` pack hook
around the code, during its forward), *outputs* what only the step's outputs keep -- the return
values of ``models``' forward calls (logits, a KV cache) and the tensors handed to the first
``backward``/``grad`` (the loss) -- and autograd did not save. ``measurement.output_parts`` names them.

Parameters and buffers of ``models`` that exist before the run count as parameters; their
``.grad`` after the run as gradients; the state of every optimizer stepped as optimizer state.
The code's side effects are kept (it runs exactly once). This is what ``%%memsave`` uses.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..workload import iter_output_tensors, iter_tensors, output_parts
from .result import Measurement
from .step import _packer, _unpack
from .summary import _summarise
from .tracker import INPUT, PARAMETER, MemoryTracker

__all__ = ["measure_callable"]


def measure_callable(
    run: Callable[[], Any],
    models: nn.Module | Iterable[nn.Module] = (),
    *,
    data: Callable[[], Iterable[Any]] | None = None,
    flops: bool = True,
) -> tuple[Measurement, Any]:
    """Run ``run()`` once under the tracker; return ``(measurement, run's return value)``.

    ``models``: the module (or modules) the code trains; the first gives the per-module rows.
    ``data``: called after the run, returns objects the code keeps (a notebook's variables); the
    tensors among them that autograd did not make (no ``grad_fn``) are the step's inputs, or
    parameters when they require grad, whenever the code made them. When no module runs, the
    forward is everything before the first backward.
    ``measurement.step_seconds`` holds the wall time of this one tracked run (tracking slows it).
    """
    model_list = [models] if isinstance(models, nn.Module) else [m for m in models if isinstance(m, nn.Module)]
    root = model_list[0] if model_list else nn.Module()
    tracker = _tracker(root if model_list else None, flops)
    for m in model_list:
        tracker.register_existing(m.parameters(), PARAMETER)
        tracker.register_existing((b for b in m.buffers() if b is not None), PARAMETER)
    device = _device_of(model_list)
    on_cuda = device.startswith("cuda")
    thread = threading.get_ident()
    forward_end: dict[str, Any] = {}
    optimizers: list[torch.optim.Optimizer] = []
    grad_records: set[int | None] = set()

    def note_grads(params: Iterable[torch.Tensor]) -> None:
        # gradients may be freed before the code ends (zero_grad): note them while they live
        grad_records.update(tracker.record_of(p.grad) for p in params if p.grad is not None)

    saw_module: list[bool] = []

    def to_forward() -> None:
        if threading.get_ident() == thread and tracker.phase == "setup":
            tracker.phase = "forward"
            saw_module.append(True)

    saved_records: set[int | None] = set()
    parts: list[tuple[str, set[int]]] = []  # the step's outputs, as the engine names them

    def note_saved(t: torch.Tensor) -> None:
        if threading.get_ident() == thread and "event" not in forward_end:  # saved in forward only
            saved_records.add(tracker.record_of(t))

    def note_output(module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == thread and "event" not in forward_end:
            for name, tensors in output_parts(output):
                parts.append((name, {r for t in tensors if (r := tracker.record_of(t)) is not None}))

    def to_backward(loss: Any = None) -> None:
        if threading.get_ident() != thread:
            return
        if "event" not in forward_end:
            if loss is not None:
                parts.append(
                    ("loss", {r for t in iter_output_tensors(loss) if (r := tracker.record_of(t)) is not None})
                )
            forward_end["event"] = len(tracker.events)
            forward_end["live"] = tracker.live_records()
        if tracker.phase in ("setup", "forward"):
            tracker.phase = "backward"

    def on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != thread:
            return
        if all(o is not optimizer for o in optimizers):
            optimizers.append(optimizer)
        note_grads(p for group in optimizer.param_groups for p in group["params"])
        tracker.phase = "optimizer"

    original_backward, original_grad = torch.autograd.backward, torch.autograd.grad

    def backward(*args: Any, **kwargs: Any) -> Any:
        to_backward(args[0] if args else kwargs.get("tensors"))
        out = original_backward(*args, **kwargs)
        if threading.get_ident() == thread:
            note_grads(p for m in model_list for p in m.parameters())
        return out

    def grad(*args: Any, **kwargs: Any) -> Any:
        to_backward(args[0] if args else kwargs.get("outputs"))
        return original_grad(*args, **kwargs)

    handles = [
        nn.modules.module.register_module_forward_pre_hook(lambda module, args: to_forward()),
        register_optimizer_step_pre_hook(on_step),
        *(m.register_forward_hook(note_output) for m in model_list),
    ]
    cuda: dict[str, int] = {}
    torch.autograd.backward, torch.autograd.grad = backward, grad
    start = time.perf_counter()
    try:
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            cuda["baseline"] = torch.cuda.memory_allocated()
        with tracker, torch.autograd.graph.saved_tensors_hooks(_packer(note_saved, tracker), _unpack):
            tracker.phase = "setup"
            result = run()
            if "event" not in forward_end:  # no backward in the code: the end is the end of forward
                forward_end["event"] = len(tracker.events)
                forward_end["live"] = tracker.live_records()
            note_grads(p for m in model_list for p in m.parameters())
            states = [t for o in optimizers for s in o.state.values() for t in iter_tensors(s)]
            tracker.grad_records = grad_records - {None}  # type: ignore[attr-defined]
            tracker.opt_records = {tracker.record_of(t) for t in states} - {None}  # type: ignore[attr-defined]
            if on_cuda:
                torch.cuda.synchronize()
                cuda["peak"] = torch.cuda.max_memory_allocated()
            del states
            tracker.phase = "done"
    finally:
        elapsed = time.perf_counter() - start
        torch.autograd.backward, torch.autograd.grad = original_backward, original_grad
        for h in handles:
            h.remove()
        tracker.module_stack.clear()
    if saw_module:
        for rec in tracker.records:  # built before any module ran: data the code made for the step
            if rec.kind is None and rec.phase == "setup":
                rec.kind = INPUT
    else:  # no module ran: the forward is whatever came before the first backward
        for rec in tracker.records:
            if rec.phase == "setup" and rec.kind is None:
                rec.phase = "forward"
        tracker.event_phase[:] = ["forward" if p == "setup" else p for p in tracker.event_phase]
    for t in data() if data is not None else ():
        if isinstance(t, torch.Tensor) and t.grad_fn is None and not _is_param_of(t, model_list):
            idx = tracker.record_of(t)
            if idx is not None and tracker.records[idx].kind is None:
                tracker.records[idx].kind = PARAMETER if t.requires_grad else INPUT
            if t.requires_grad and t.grad is not None:  # a leaf the code trains by hand
                g = tracker.record_of(t.grad)
                if g is not None:
                    tracker.grad_records.add(g)  # type: ignore[attr-defined]
    tracker.forward_end = forward_end  # type: ignore[attr-defined]
    tracker.saved_records = saved_records - {None}  # type: ignore[attr-defined]
    tracker.output_records = set().union(*(records for _, records in parts))  # type: ignore[attr-defined]
    if not hasattr(tracker, "flop_counts"):
        tracker.flop_counts = {}  # type: ignore[attr-defined]
    # the cell is its own loop: whatever it keeps (an ``out`` it holds) lives to the cell's end,
    # so its advice is that of the loop that keeps the output through the step
    workload = SimpleNamespace(model=root, device=device, loop="keep_output_step")
    measurement = _summarise(tracker, workload, "real", [elapsed], cuda, output_parts=parts)  # type: ignore[arg-type]
    return measurement, result


def _is_param_of(t: torch.Tensor, models: list[nn.Module]) -> bool:
    return isinstance(t, nn.Parameter) and any(t is p for m in models for p in m.parameters())


def _tracker(model: nn.Module | None, flops: bool) -> MemoryTracker:
    try:
        return MemoryTracker(model, count_flops=flops)
    except TypeError:  # a tracker without FLOP counting
        return MemoryTracker(model)


def _device_of(models: list[nn.Module]) -> str:
    for m in models:
        for t in m.parameters():
            return str(t.device)
    return "cpu"
