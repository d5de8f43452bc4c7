"""``RestorePoint``: what ``Plan.apply`` changes in a model, recorded first and put back exactly
on exit (module attributes, hooks, parameters' flags and values, buffers). Knows nothing of
plans."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from memsave_nb.model_state import bits_equal as _bits_equal

# -- exact restore -------------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_MISSING = object()


def _same_items(current: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
    """Same keys in the same order, each bound to the very same object (never ``==`` on tensors)."""
    return list(current) == list(saved) and all(current[k] is saved[k] for k in saved)


class RestorePoint:
    """What a plan may touch on a model, taken before and put back after.

    Structure and flags are kept by reference (cheap): each module's class, ``training``,
    child/parameter/buffer dicts, instance ``forward``, hook dicts and the set of instance
    attribute names (ones added meanwhile are removed); each parameter's
    ``requires_grad`` and ``.grad`` object. Buffers are copied (they are small: running
    statistics) and written back when their bits differ (compared by value: the CPU batch-norm
    kernel updates running statistics without bumping their version). A buffer or parameter
    re-assigned meanwhile (``self.count = self.count + 1`` in forward) is put back as the very
    object it was. Parameters are not copied
    (the measuring engine undoes its own optimizer step); with ``copy_parameters=True`` they are,
    and are written back the same way.
    """

    def __init__(self, model: nn.Module, *, copy_parameters: bool = False) -> None:
        self.model = model
        self.modules: list[tuple[nn.Module, dict[str, Any]]] = []
        for module in model.modules():
            record = {
                "class": module.__class__,
                "training": module.training,
                "_modules": dict(module._modules),
                "_parameters": dict(module._parameters),
                "_buffers": dict(module._buffers),
                "forward": module.__dict__.get("forward", _MISSING),
                "_compiled_call_impl": module.__dict__.get("_compiled_call_impl", _MISSING),
                "attrs": frozenset(module.__dict__),
            }
            for hooks in _HOOK_DICTS:
                d = module.__dict__.get(hooks, _MISSING)
                record[hooks] = _MISSING if d is _MISSING else (d, dict(d))
            self.modules.append((module, record))
        self.params: dict[int, tuple[nn.Parameter, bool, Any, int, torch.Tensor | None]] = {}
        for module, _ in self.modules:
            for p in module._parameters.values():
                if p is None or id(p) in self.params:
                    continue
                copy = p.detach().clone() if copy_parameters else None
                self.params[id(p)] = (p, p.requires_grad, p.grad, p._version, copy)
        self.buffers: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        for module, _ in self.modules:
            for b in module._buffers.values():
                if b is None or id(b) in self.buffers:
                    continue
                self.buffers[id(b)] = (b, b._version, b.detach().clone())

    def restore(self) -> None:
        for module, record in self.modules:
            if module.__class__ is not record["class"]:
                module.__class__ = record["class"]
            module.training = record["training"]
            for key in ("_modules", "_parameters", "_buffers"):
                current = module.__dict__[key]
                if not _same_items(current, record[key]):
                    current.clear()
                    current.update(record[key])
            for key in set(module.__dict__) - record["attrs"]:
                del module.__dict__[key]  # e.g. torch.compile marks the module it wraps
            for key in ("forward", "_compiled_call_impl"):
                if record[key] is _MISSING:
                    module.__dict__.pop(key, None)
                else:
                    module.__dict__[key] = record[key]
            for hooks in _HOOK_DICTS:
                saved = record[hooks]
                if saved is _MISSING:
                    continue
                d, items = saved
                module.__dict__[hooks] = d
                if list(d.items()) != list(items.items()):
                    d.clear()
                    d.update(items)
        with torch.no_grad():
            for p, flag, grad, version, copy in self.params.values():
                if p.requires_grad != flag:
                    p.requires_grad_(flag)
                if p.grad is not grad:
                    p.grad = grad
                if copy is not None and (p._version != version or not _bits_equal(p, copy)):
                    p.copy_(copy)
            for b, version, copy in self.buffers.values():
                # by value, not version: native_batch_norm updates running statistics in place
                # without bumping their version counter (CPU kernels)
                if b.shape != copy.shape or b.dtype != copy.dtype:
                    b.data = copy  # resized or cast in place: the copy becomes its data
                elif b._version != version or not _bits_equal(b, copy):
                    b.copy_(copy)
