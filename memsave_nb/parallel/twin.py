"""A fake twin of the user's model: same module tree and classes, fake parameters and buffers.

``fully_shard`` and DDP change modules in place (class, parameters, hooks), so they are applied to
the twin, never to the user's model. The twin is a ``copy.deepcopy`` whose memo maps every
parameter, buffer and tensor attribute to a fake tensor of the same shape, stride, dtype and
``requires_grad`` (created under ``fake_mode``, on the CPU, which stands in for the accelerator):
no tensor data is copied, whatever the model's size or device (meta included).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def _fake_like(t: torch.Tensor, fake_mode, meta: bool = False) -> torch.Tensor:
    if meta:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
    with fake_mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


def fake_twin(model: nn.Module, fake_mode, *, meta: bool = False) -> nn.Module:
    """A structural copy of ``model`` holding fake tensors of ``fake_mode``; ``model`` is not touched.

    ``meta``: parameters and buffers on the meta device instead, for a mesh that cannot be built
    in fake mode (FSDP2 x TP): shard the twin, then ``to_empty`` it inside ``fake_mode``.
    """
    memo: dict[int, object] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(_fake_like(p, fake_mode, meta), requires_grad=p.requires_grad)
        for b in mod._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = _fake_like(b, fake_mode, meta)
        for v in vars(mod).values():  # plain tensor attributes (caches, masks)
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = _fake_like(v, fake_mode)
    return copy.deepcopy(model, memo)
