"""Capture and restore everything a measured step may change in a model.

A step runs an optimizer update, advances batch-norm statistics and fills ``.grad``; a memory
tool must leave the user's model exactly as it found it. ``ModelSnapshot`` keeps copies of
parameter and buffer values (bit for bit), ``.grad`` references, ``requires_grad`` flags,
train/eval modes, module objects, instance attributes that shadow methods, and hook counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_SLOTS = ("_modules", "_parameters", "_buffers")
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@dataclass
class ModelSnapshot:
    values: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    requires_grad: dict[str, bool]
    training: dict[str, bool]
    modules: dict[str, nn.Module]
    classes: dict[str, type]
    instance_attrs: dict[str, frozenset[str]]
    hook_counts: dict[str, tuple[int, ...]]
    _extra: dict[str, Any] = field(default_factory=dict)
    #: per module object: its child, parameter and buffer dicts' items (objects, not copies), so
    #: that a forward re-assigning one (``self.count = self.count + 1``) is undone
    slots: list[tuple[nn.Module, tuple[dict[str, Any], ...]]] = field(default_factory=list)

    @classmethod
    def capture(cls, model: nn.Module, *, copy_values: bool = True) -> "ModelSnapshot":
        tensors: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            tensors["p:" + name] = p
        for name, b in model.named_buffers(remove_duplicate=False):
            if b is not None:
                tensors["b:" + name] = b
        values = {}
        if copy_values:
            for k, t in tensors.items():
                if _is_fake_or_meta(t):
                    continue
                values[k] = t.detach().to("cpu", copy=True) if t.device.type == "cuda" else t.detach().clone()
        modules = dict(model.named_modules(remove_duplicate=False))
        return cls(
            values=values,
            tensors=tensors,
            grads={k: t.grad for k, t in tensors.items() if k.startswith("p:")},
            requires_grad={k: t.requires_grad for k, t in tensors.items() if k.startswith("p:")},
            training={n: m.training for n, m in modules.items()},
            modules=modules,
            classes={n: type(m) for n, m in modules.items()},
            instance_attrs={n: frozenset(vars(m)) for n, m in modules.items()},
            hook_counts={n: hook_counts(m) for n, m in modules.items()},
            slots=[(m, tuple(dict(m.__dict__[k]) for k in _SLOTS)) for m in model.modules()],
        )

    def restore(self, model: nn.Module) -> None:
        """Put values, grads, flags and modes back into the same tensor and module objects;
        put back submodules, parameters and buffers that were re-assigned meanwhile."""
        for module, saved in self.slots:
            for key, items in zip(_SLOTS, saved):
                current = module.__dict__[key]
                if list(current) != list(items) or any(current[k] is not v for k, v in items.items()):
                    current.clear()
                    current.update(items)
        with torch.no_grad():
            for k, value in self.values.items():
                t = self.tensors[k]
                if t.shape != value.shape:
                    continue
                t.copy_(value.to(t.device))
        for k, t in self.tensors.items():
            if k.startswith("p:"):
                t.grad = self.grads[k]
                if t.requires_grad != self.requires_grad[k]:
                    t.requires_grad_(self.requires_grad[k])
        for name, mod in self.modules.items():
            mod.training = self.training[name]

    def differences(self, model: nn.Module) -> list[str]:
        """What differs between the model now and this snapshot (empty when restored exactly)."""
        now = ModelSnapshot.capture(model, copy_values=False)
        diffs: list[str] = []
        if set(now.modules) != set(self.modules):
            diffs.append(f"module names changed: {sorted(set(now.modules) ^ set(self.modules))[:5]}")
        for n, m in self.modules.items():
            if now.modules.get(n) is not m:
                diffs.append(f"module object {n!r} replaced")
            elif type(m) is not self.classes[n]:
                diffs.append(f"module {n!r} type {type(m).__name__} != {self.classes[n].__name__}")
            if now.training.get(n) != self.training[n]:
                diffs.append(f"module {n!r} training mode changed")
            if now.instance_attrs.get(n) != self.instance_attrs[n]:
                diffs.append(f"module {n!r} instance attributes changed")
            if now.hook_counts.get(n) != self.hook_counts[n]:
                diffs.append(f"module {n!r} hook counts changed")
        for k, t in self.tensors.items():
            if now.tensors.get(k) is not t:
                diffs.append(f"tensor {k[2:]!r} object replaced")
                continue
            if k in self.values and not bits_equal(t, self.values[k]):
                diffs.append(f"tensor {k[2:]!r} values changed")
            if k.startswith("p:"):
                if t.requires_grad != self.requires_grad[k]:
                    diffs.append(f"parameter {k[2:]!r} requires_grad changed")
                if t.grad is not self.grads[k]:
                    diffs.append(f"parameter {k[2:]!r} grad changed")
        return diffs


def hook_counts(module: nn.Module) -> tuple[int, ...]:
    return tuple(len(getattr(module, d, {}) or {}) for d in _HOOK_DICTS)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN equals NaN). Fake and meta tensors have no bits: equal
    when shape and dtype are."""
    if _is_fake_or_meta(a) or _is_fake_or_meta(b):
        return a.shape == b.shape and a.dtype == b.dtype
    b = b.to(a.device)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(
        torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def _is_fake_or_meta(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"
