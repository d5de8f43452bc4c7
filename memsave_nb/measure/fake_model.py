"""Fake mode's model: parameters and buffers swapped for fake twins for one run, and the tests
for fake or meta tensors. Used by the step runner and the planner's fake estimate."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

def _fake_twin(fake_mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor for ``t``; a meta tensor presents as the workload's device (as if built there
    under ``FakeTensorMode``)."""
    if t.device.type == "meta" and device.type != "meta":
        with fake_mode:
            twin = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return twin.requires_grad_(t.requires_grad) if t.requires_grad and t.is_leaf else twin
    return fake_mode.from_tensor(t)


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
