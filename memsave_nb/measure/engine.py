"""``measure()``: run one training step for real or with fake tensors, under the tracker.

The step is forward, loss, backward and (when the workload has one) the optimizer's first step.
Everything it changes in the model (weights, batch-norm statistics, grads) is put back afterwards.

The step runner is ``step.py``, the summary ``summary.py``, the hints ``advice.py``; the names
other modules took from here are re-exported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

import torch
from torch import nn

from ..errors import WorkloadError, quoted
from ..model_state import ModelSnapshot
from ..workload import Workload, iter_tensors
from . import fake_compat
from .cuda_attention import attention_notes, sized_attention
from .cuda_autocast import autocast_note, sized_autocast
from .common import clear_grads, cuda_step_note, foreach_note, model_lock, single_tensor_default  # noqa: F401 - re-exported
from .fake_model import _fake_model, _has_fake_tensors
from .gc_pause import collector_paused
from .result import Measurement
from .step import _packer, _run, _unpack  # noqa: F401 - re-exported
from .summary import _summarise
from .workspace import workspace_notes

MODES = ("real", "fake")


def measure(
    workload: Workload,
    mode: str = "real",
    *,
    repeats: int = 3,
    flops: bool = True,
    cancel_event: threading.Event | None = None,
    steady_state: bool = True,
    first_step_peak: bool = False,
    on_memory: Callable[[Measurement], None] | None = None,
) -> Measurement:
    """Measure one training step of ``workload``: peak and its split, saved activations and
    outputs per module and op, a live-bytes timeline, FLOPs and (real mode) the median step time.

    ``steady_state=True`` (default) measures the step as training's step 2 and later: the
    optimizer's state exists from the start, grads cleared per the workload's ``set_to_none``.
    The optimizer makes that state itself, the cheapest way it can (``_init_group``, or a step on
    zero gradients), not by a whole first step; an optimizer not known to make the same state so
    gets a whole first step. ``first_step_peak=True`` runs that first step (under a light
    tracker) in every case, for ``first_step_peak_bytes``: slower, by about one more step.
    ``first_step_peak_bytes`` is None when the first step did not run. ``steady_state=False``
    measures the first step (its peak is also ``first_step_peak_bytes``).

    ``mode="fake"`` runs the same steps under ``FakeTensorMode``: shapes and bytes without memory
    or compute, for models too large for this machine. The model is left as it was.

    ``on_memory(m)``: called on this thread as soon as the tracked step is done, before the timed
    steps, with the memory numbers (the returned measurement's, ``step_seconds`` None), so a UI
    can show them while the step is timed. Only when timed steps follow (real mode, repeats > 0).
    """
    if mode not in MODES:
        raise WorkloadError(f"unknown mode {quoted(mode)}; choose 'real' or 'fake'")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise WorkloadError(f"repeats must be a whole number >= 0, got {quoted(repeats)}")
    if not isinstance(steady_state, bool):
        raise WorkloadError(f"steady_state must be True or False, got {quoted(steady_state)}")
    if not isinstance(first_step_peak, bool):
        raise WorkloadError(f"first_step_peak must be True or False, got {quoted(first_step_peak)}")
    try:  # torch's own message quotes a device string whole
        torch.device(workload.device)
    except (RuntimeError, TypeError, ValueError):
        raise WorkloadError(f"unknown device {quoted(getattr(workload, 'device', None))}") from None
    if _is_compiled(workload.model):
        # Inside a compiled graph allocations bypass Python dispatch: count them from the
        # profiler's memory events instead (no per-module rows there).
        if mode == "fake":
            raise WorkloadError("a torch.compile'd model cannot be measured in fake mode; measure it in real mode")
        from .compiled import measure_compiled

        return measure_compiled(
            workload, mode=mode, repeats=repeats, cancel_event=cancel_event, steady_state=steady_state
        )
    model = workload.model
    with model_lock(model):  # a concurrent fake-mode run swaps the parameters: check inside the lock
        if mode == "real" and _has_fake_tensors(model):
            raise WorkloadError(
                f"the model of {workload.name!r} holds fake or meta tensors (built under FakeTensorMode or on the meta device): measure it with mode='fake'"
            )
        snapshot = ModelSnapshot.capture(model, copy_values=(mode == "real"))
        attention = autocast = None
        leaves = _user_leaf_grads(workload)

        def restore() -> None:  # before a measurement runs again the old way (step.py's _run)
            if mode == "real":
                snapshot.restore(model)
            for t, _ in leaves:
                t.grad = None

        try:
            if mode == "fake":
                with (
                    collector_paused(),
                    _fake_model(model, workload.device) as fake_mode,
                    fake_compat.same_path_as_real(workload),
                    sized_attention(workload) as attention,
                    sized_autocast(workload) as autocast,
                ):
                    result = _run(
                        workload,
                        fake_mode=fake_mode,
                        flops=flops,
                        cancel_event=cancel_event,
                        steady_state=steady_state,
                        repeats=0,
                        first_step_peak=first_step_peak,
                        restore=restore,
                    )
            else:  # CUDA's autocast lists run on real CPU tensors too (its attention kernels do not)
                with sized_autocast(workload) as autocast:
                    result = _run(
                        workload,
                        fake_mode=None,
                        flops=flops,
                        cancel_event=cancel_event,
                        steady_state=steady_state,
                        repeats=repeats,
                        first_step_peak=first_step_peak,
                        restore=restore,
                        after_tracked=_memory_first(workload, steady_state, on_memory),
                    )
        finally:
            snapshot.restore(model)
            for t, g in leaves:
                t.grad = g
    tracker, cuda, times, first_peak, parts, optimizer_kind = result
    with collector_paused() if mode == "fake" else contextlib.nullcontext():  # gc_pause.py: its per-module rows too
        m = _summarise(
            tracker,
            workload,
            mode,
            times,
            cuda,
            first_step_peak=first_peak,
            steady_state=steady_state,
            output_parts=parts,
        )
    if mode == "fake" and optimizer_kind is not None:
        m = dataclasses.replace(m, notes=m.notes + (foreach_note(optimizer_kind),))
    if workload.sized_for == "cuda":
        m = dataclasses.replace(
            m,
            notes=(
                cuda_step_note(
                    attention.backends if attention else None,
                    workload.__dict__.get("cuda_step"),
                    mode == "real" and torch.device(workload.device).type == "cpu",
                    autocast=autocast is not None,
                ),
            )
            + m.notes
            + autocast_note(autocast)
            + attention_notes(attention),
        )
    if tracker.workspace_statuses:
        m = dataclasses.replace(m, notes=m.notes + workspace_notes(tracker.workspace_statuses))
    return m


def _memory_first(workload: Workload, steady_state: bool, on_memory: Callable[[Measurement], None] | None):
    """The step runner's ``after_tracked`` for ``on_memory``: the real-mode measurement without
    its times, summarised from the tracked step as the final one will be."""
    if on_memory is None:
        return None

    def after_tracked(tracker, cuda, first_peak, parts) -> None:
        m = _summarise(
            tracker,
            workload,
            "real",
            [],
            cuda,
            first_step_peak=first_peak,
            steady_state=steady_state,
            output_parts=parts,
        )
        if tracker.workspace_statuses:
            m = dataclasses.replace(m, notes=m.notes + workspace_notes(tracker.workspace_statuses))
        on_memory(m)

    return after_tracked


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
