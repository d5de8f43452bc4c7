"""Dropout keeping a 1-bit packed mask for backward.

On the CPU stock dropout multiplies by a float noise tensor and keeps it (4 bytes per element
in float32); on CUDA it keeps a bool mask (1 byte). Backward needs only which elements were
kept: 1 bit. We draw the random numbers exactly as stock does on each device, so outputs and
gradients match stock bit for bit under the same seed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._bits import pack_bits, unpack_bits

_FUSED_DEVICES = {"cuda", "xpu", "lazy", "privateuseone"}


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, inplace: bool) -> Tensor:
        ctx.shape = x.shape
        if x.device.type in _FUSED_DEVICES:
            out, mask = torch.native_dropout(x, p, True)  # what stock runs there
            ctx.fused = True
            if inplace:
                x.copy_(out)
                out = x
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)  # the stock CPU draw
            noise.div_(1 - p)
            mask = noise != 0
            ctx.fused = False
            out = x.mul_(noise) if inplace else x * noise
        if inplace:
            ctx.mark_dirty(x)
        ctx.p = p
        ctx.save_for_backward(pack_bits(mask))
        return x if inplace else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (packed,) = ctx.saved_tensors
        if ctx.fused:  # stock's own backward kernel there
            mask = unpack_bits(packed, ctx.shape)
            return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1 - ctx.p)), None, None
        # grad * noise as stock, with noise = scale * mask; scale computed as forward did
        scale = torch.ones((), dtype=grad.dtype, device=grad.device).div_(1 - ctx.p)
        return grad.mul(scale).mul_(unpack_bits(packed, ctx.shape, torch.uint8)), None, None


def masked_dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
                   ) -> Tensor:
    """``F.dropout`` keeping a 1-bit mask; the trivial cases (eval, p in {0, 1}, no grad) are
    stock, where nothing or no mask is kept anyway."""
    if not (training and 0.0 < p < 1.0 and torch.is_grad_enabled() and x.requires_grad
            and x.numel() > 0):
        return F.dropout(x, p, training, inplace)
    _holder.compact(_holder.RECENT)
    return _Dropout.apply(x, p, inplace)


class MemSaveDropout(nn.Dropout):
    """``nn.Dropout`` keeping ceil(N/8) bytes for backward."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_dropout(input, self.p, self.training, self.inplace)
