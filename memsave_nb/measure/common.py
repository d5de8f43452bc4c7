"""Helpers both step runners share (the dispatch engine and the compiled one): the per-model lock,
clearing grads between steps, and the note on the optimizer's CPU single-tensor default.

Below ``engine``, ``step`` and ``compiled``: it imports none of them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

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


def single_tensor_default(optimizer: Any) -> str | None:
    """The optimizer's class name when it was left to pick its implementation (``foreach=None``,
    not fused) over CPU parameters: torch then runs its single-tensor loop, while on a CUDA GPU the
    same constructor picks the foreach step, whose temporaries are larger. None otherwise. A wrapper
    with an ``_inner`` optimizer (fp32 master weights: its own ``defaults`` are empty) is read
    inside."""
    inner = getattr(optimizer, "_inner", None)
    if isinstance(inner, torch.optim.Optimizer):
        return single_tensor_default(inner)
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


def cuda_step_note(
    attention: dict[str, int] | None = None, step: str | None = "foreach", real: bool = False, autocast: bool = False
) -> str:
    """What a workload sized for CUDA (``Workload.sized_for="cuda"``) ran, said once under its numbers:
    the optimizer's step (``follow_cuda_default``'s answer: "foreach", "fused", "single-tensor" as
    asked, None without the choice), in fake mode the attention backend CUDA picks (a real CPU step
    cannot run CUDA's kernels: ``real`` says its attention was the CPU's) and, with ``autocast``,
    that autocast ran CUDA's op lists (``cuda_autocast.sized_autocast``), real or fake."""
    from .cuda_attention import title_words

    words = [f"{step} optimizer step"] if step else []
    words += [title_words(attention)] if attention else (["the CPU's attention (a real step)"] if real else [])
    words += ["CUDA's autocast lists"] if autocast else []
    why = {
        "foreach": "the optimizer left to pick its implementation takes torch's GPU default, the foreach step "
        "(its temporaries counted)",
        "fused": "the fused step asked for (the trainer's adamw_torch_fused default) runs in place",
    }.get(step or "", "the optimizer runs as asked")
    return f"sized as CUDA runs it: {', '.join(words) or 'no optimizer step'}. On a CPU twin of the step: {why}"


def sized_words(notes: tuple[str, ...] | list[str]) -> str:
    """The title's words for a step sized as CUDA runs it, from its first note (``cuda_step_note``):
    ``", sized as CUDA runs it (foreach optimizer step, flash attention)"``; "" for any other step."""
    head = "sized as CUDA runs it: "
    note = next((n for n in notes if n.startswith(head)), None)
    return "" if note is None else f", sized as CUDA runs it ({note[len(head) :].split('.')[0]})"


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
