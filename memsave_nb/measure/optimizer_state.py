"""The optimizer's state as its first step makes it, without running that step's forward and
backward: the single-device engine's and ``parallel/``'s way to reach steady state cheaply.

Adam / AdamW make their state with their own ``_init_group`` (no update arithmetic); the other
optimizers listed in ``ZERO_GRAD_STEP`` take one ``step()`` on zero gradients, which makes the same
state as a first training step (its shapes and dtypes follow the parameters, not the gradients'
values). Any other optimizer is not trusted to do so: the engine runs a whole first step for it.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, ContextManager, Iterable

import torch

_INIT_GROUP_ARGS = (
    "self",
    "group",
    "params_with_grad",
    "grads",
    "exp_avgs",
    "exp_avg_sqs",
    "max_exp_avg_sqs",
    "state_steps",
)


def _zero_grad_step_types() -> tuple[type, ...]:
    names = ("SGD", "Adagrad", "Adafactor", "Adam", "AdamW")
    return tuple(getattr(torch.optim, n) for n in names if hasattr(torch.optim, n))


# torch's own optimizers whose state a step on zero gradients makes byte for byte as a first step
# would (tests/measure/test_one_step_state.py compares both on every optimizer the knobs offer)
ZERO_GRAD_STEP = _zero_grad_step_types()


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Create Adam's / AdamW's state with their own ``_init_group``, without the update's arithmetic.

    The first ``step()`` creates the state there (``step``, ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with amsgrad) for every parameter with a gradient, then updates in place;
    the update allocates nothing that outlives it, so the state is the first step's, byte for byte
    (``step`` holds 0 instead of 1). On DTensor parameters the update is the warm-up's largest cost.
    False (nothing done) for any other optimizer or a torch whose ``_init_group`` differs. A wrapper
    with ``init_state_on_zero_grads()`` makes its own (True when it could).
    """
    own = getattr(optimizer, "init_state_on_zero_grads", None)  # a wrapper's own (the knobs' fp32 masters)
    if callable(own):
        return bool(own())
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    init = getattr(type(optimizer), "_init_group", None)
    try:
        if init is None or tuple(inspect.signature(init).parameters) != _INIT_GROUP_ARGS:
            return False
    except (TypeError, ValueError):  # pragma: no cover
        return False
    with torch.no_grad():
        for group in optimizer.param_groups:
            init(optimizer, group, [], [], [], [], [], [])
    return True


def make_state_on_zero_grads(
    optimizer: torch.optim.Optimizer, trainable: Iterable[torch.Tensor], step_context: ContextManager[Any] | None = None
) -> None:
    """Give each trainable parameter a zero gradient and let the optimizer make its state
    (``_init_group`` where it can, else one ``step()``, its hooks not called). The gradients stay: the caller drops or
    keeps them (``zero_grad(set_to_none=False)``)."""
    for p in trainable:
        p.grad = torch.zeros_like(p)
    if not init_optimizer_state(optimizer):
        with step_context or contextlib.nullcontext():
            _step_without_hooks(optimizer)


def _step_without_hooks(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without its step hooks (the user's, the global ones, a scheduler's
    wrapper): this step only makes state, on zero gradients; a hook that reads gradients (a
    logger, a test's capture, clipping) must see the tracked step's, as it would in training."""
    hooked = type(optimizer).step
    raw = getattr(hooked, "__wrapped__", None)
    if getattr(hooked, "hooked", False) and callable(raw):
        raw(optimizer)
    else:  # pragma: no cover - a torch that wraps step differently
        optimizer.step()


def makes_state_without_a_step(optimizer: Any) -> bool:
    """True for an optimizer whose first-step state ``make_state_on_zero_grads`` reproduces: one of
    ``ZERO_GRAD_STEP``, or a wrapper that says so of itself (``makes_state_on_zero_grads`` True: the
    knobs' fp32 master weights over one of those)."""
    return (
        optimizer is None
        or type(optimizer) in ZERO_GRAD_STEP
        or getattr(optimizer, "makes_state_on_zero_grads", False) is True
    )
