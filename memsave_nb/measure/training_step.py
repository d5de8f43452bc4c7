"""The one training step every runner measures: the loop the user runs, written out once.

Why one: the engine, the per-rank runner (FSDP2 / DDP / TP) and the compiled runner each used to
carry their own copy of this loop, and a fix to one (the output's life, the loss / k, the
requires-grad check) had to be made three times. The runners keep their setup and measurement
around it and reach into it only through the callbacks below. ``CALLS`` counts the runs per
caller so a test can see every runner went through this one function.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, ContextManager

import torch

from ..errors import WorkloadError
from ..workload import Workload, output_dropped

__all__ = ["training_step", "optimizer_step", "CALLS"]

CALLS: collections.Counter[str] = collections.Counter()  # runner name -> steps run through here


def _no_phase(phase: str, last: bool) -> None:
    return None


def _no_context(phase: str, last: bool) -> ContextManager[Any]:
    return contextlib.nullcontext()


def training_step(
    workload: Workload,
    next_batch: Callable[[bool], Any],
    optimizer: Any,
    *,
    runner: str,
    forward: Callable[[Any], Any] | None = None,
    on_phase: Callable[[str, bool], None] = _no_phase,
    context: Callable[[str, bool], ContextManager[Any]] = _no_context,
    on_forward_end: Callable[[Any, torch.Tensor], None] | None = None,
) -> tuple[Any, Any, Any]:
    """One optimizer step: ``accumulation_steps`` k micro-steps (batch, forward, loss / k,
    backward), then ``optimizer.step()``; the last micro-step's output lives as ``workload.loop``
    says (``output_dropped``); the loss lives to the end of the step (a trainer logs it).

    ``next_batch(last)`` gives each micro-step's batch; ``forward(batch)`` calls the model
    (default ``workload.forward``); ``on_phase(phase, last)`` is told "forward", "loss",
    "backward", "optimizer" and "done" as they start; ``context(phase, last)`` wraps forward (with
    the loss), backward and the optimizer step; ``on_forward_end(output, loss)`` sees the last
    micro-step's output and loss. ``optimizer``: an optimizer, None, or a function giving either
    when the step reaches it (the engine makes its optimizer at the first batch). Gradients are not cleared here: between steps, as the loop does.
    Returns the last ``(batch, output, loss)`` (output None where the loop dropped it), so the
    caller decides when they die."""
    CALLS[runner] += 1
    forward = forward if forward is not None else workload.forward
    k = workload.accumulation_steps
    batch = output = loss = None
    for micro in range(k):
        last = micro == k - 1
        batch = next_batch(last)
        on_phase("forward", last)
        with context("forward", last):
            output = forward(batch)
            on_phase("loss", last)
            loss = workload.compute_loss(output)
            if k > 1:
                loss = loss / k
        if not loss.requires_grad:
            raise WorkloadError("the loss does not depend on anything that requires grad")
        if on_forward_end is not None and last:
            on_forward_end(output, loss)
        if output_dropped(workload.loop, "backward"):
            output = None  # the workload's loop: only the loss goes into backward
        on_phase("backward", last)
        with context("backward", last):
            loss.backward()
        if not last:
            batch = output = loss = None  # a micro-step's batch, output and loss die with it
        elif output_dropped(workload.loop, "step"):
            output = None
    optimizer_step(optimizer, on_phase=on_phase, context=context)
    return batch, output, loss


def optimizer_step(
    optimizer: Any,
    *,
    on_phase: Callable[[str, bool], None] = _no_phase,
    context: Callable[[str, bool], ContextManager[Any]] = _no_context,
) -> None:
    """The step's end: ``optimizer.step()`` (when there is one), then "done". The pipeline runner
    calls it after torch's schedule, which runs the micro-batches' forwards and backwards itself."""
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer()
    if optimizer is not None:
        on_phase("optimizer", True)
        with context("optimizer", True):
            optimizer.step()
    on_phase("done", True)
