"""Fake mode's model: parameters and buffers swapped for fake twins for one run, and the tests
for fake or meta tensors. Used by the step runner and the planner's fake estimate."""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Iterator, TypeGuard

import torch
from torch import nn

from .fake_dispatch import quick_dispatch

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensor


def _fake_twin(fake_mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor for ``t``; a meta tensor presents as the workload's device (as if built there
    under ``FakeTensorMode``)."""
    if t.device.type == "meta" and device.type != "meta":
        with fake_mode:
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return twin.requires_grad_(t.requires_grad) if t.requires_grad and t.is_leaf else twin
    return fake_mode.from_tensor(t)


def _is_fake(t: torch.Tensor) -> TypeGuard[FakeTensor]:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _has_fake_tensors(model: nn.Module) -> bool:
    return any(_is_fake(t) or t.device.type == "meta" for t in _params_and_buffers(model))


def _params_and_buffers(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from (b for b in model.buffers() if b is not None)


class _Twins:
    """One model's fake twins, kept between its fake runs (a weak key of the model): the explorer's
    clicks, the planner's and max batch's probes each swapped in a fresh set before, one
    ``FakeTensorMode`` and ``from_tensor`` per parameter per run. A twin is reused while its real
    tensor is the same object with the same shape, strides, dtype and device (a twin holds nothing
    else: fake tensors have no values); anything else gets a new one. The model's lock
    (``measure.engine.model_lock``) is held around every use."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)  # loss closures may hold real targets
        self._by_id: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}

    def twin(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        sig = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, device)
        hit = self._by_id.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == sig:
            return hit[2]
        fake = _fake_twin(self.mode, t.detach(), device)
        self._by_id[id(t)] = (weakref.ref(t), sig, fake)
        return fake

    def forget_dead(self) -> None:
        """Drop twins of dead tensors, and what the long-lived mode remembers of dead tensors.

        ``FakeTensorMode``'s converter maps every storage of a constant it made (the optimizer's
        ``step`` counters, scalars built in fake mode) to its fake tensors and never prunes that
        map: with one mode kept for a model's whole session it grew by a few entries per run
        (8 per MLP run, about 10 KB), so ``Session.clear`` could not give that memory back."""
        self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}
        mapping = getattr(getattr(self.mode, "fake_tensor_converter", None), "constant_storage_mapping", None)
        if isinstance(mapping, dict):
            for key in [k for k, refs in mapping.items() if _expired(k) or all(r() is None for r in refs)]:
                del mapping[key]


def _expired(storage_ref: Any) -> bool:
    expired = getattr(storage_ref, "expired", None)
    return bool(expired()) if callable(expired) else False


WRAP_IN_MODE = True  # False: each Parameter wrapper made outside the mode (bench/edit_speed.py's "before")

_TWINS: "weakref.WeakKeyDictionary[nn.Module, _Twins]" = weakref.WeakKeyDictionary()


def _twins_of(model: nn.Module) -> _Twins:
    twins = _TWINS.get(model)
    if twins is None:
        twins = _TWINS[model] = _Twins()
    return twins


@contextlib.contextmanager
def _fake_model(model: nn.Module, device: str | torch.device = "cpu") -> Iterator[Any]:
    """Swap parameters and buffers for fake twins (same shapes, dtypes, devices); swap back on exit.

    A model built under ``FakeTensorMode`` already has fake tensors: its own mode is reused.
    Tensors on the meta device (``with torch.device("meta")``, ``init_empty_weights``) get twins
    on the workload's device, as if the model had been built there under ``FakeTensorMode``.
    The twins (and their mode) are kept for the model's next fake run (:class:`_Twins`); each run
    wraps them in new ``nn.Parameter`` objects, so no gradient or flag outlives a run. While the
    block runs the mode answers its dispatch cache's hits the quick way (``fake_dispatch.py``).
    """
    existing = next((t.fake_mode for t in list(model.parameters()) + list(model.buffers()) if _is_fake(t)), None)
    if existing is not None:
        with quick_dispatch(existing):
            yield existing
        return
    twins = _twins_of(model)
    stack = contextlib.ExitStack()
    target = torch.device(device)
    swapped: list[tuple[nn.Module, str, str, Any]] = []
    fakes: dict[int, Any] = {}
    try:
        stack.enter_context(quick_dispatch(twins.mode))  # wrapping a twin in a Parameter is an op (detach)
        slots: list[tuple[nn.Module, str, str, Any]] = []
        to_wrap: list[tuple[int, bool]] = []  # parameters met first as parameters: Parameter wrappers
        for mod in model.modules():
            for where in ("_parameters", "_buffers"):
                for name, t in list(getattr(mod, where).items()):
                    if t is None:
                        continue
                    if id(t) not in fakes:
                        fakes[id(t)] = twins.twin(t, target)
                        if where == "_parameters":
                            to_wrap.append((id(t), t.requires_grad))
                    slots.append((mod, where, name, t))
        # inside the mode: each wrapper's detach goes straight to it, not through FakeTensor's own
        # dispatch, which enters and leaves the mode per tensor (half the swap's 16 ms on a 0.5B model)
        with twins.mode if WRAP_IN_MODE else contextlib.nullcontext():
            for key, requires_grad in to_wrap:
                fakes[key] = nn.Parameter(fakes[key], requires_grad=requires_grad)
        for mod, where, name, t in slots:
            swapped.append((mod, where, name, t))
            getattr(mod, where)[name] = fakes[id(t)]
        twins.forget_dead()
        yield twins.mode
    finally:
        for mod, where, name, original in reversed(swapped):
            getattr(mod, where)[name] = original
        stack.close()
