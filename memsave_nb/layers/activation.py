"""ReLU and LeakyReLU that keep 1 bit per element for backward instead of a float tensor."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._bits import pack_bits, unpack_bits


class _MaskedLeakyReLU(torch.autograd.Function):
    """``y = x if x > 0 else slope * x``; backward needs only the sign mask (slope 0 is ReLU)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, slope: float, inplace: bool, lazy: bool) -> Tensor:
        ctx.slope = slope
        ctx.shape = x.shape
        # With slope < 0 the output's sign no longer tells the input's: mask from the input.
        lazy = lazy and slope >= 0
        mask = None if lazy else x > 0
        if slope == 0.0:
            out = torch.relu_(x) if inplace else torch.relu(x)
        else:
            out = F.leaky_relu_(x, slope) if inplace else F.leaky_relu(x, slope)
        if inplace:
            ctx.mark_dirty(x)
        if lazy:
            holder = _holder.OutputHolder(out)
            ctx.holder = holder
            _holder.register(holder)
            ctx.save_for_backward()
        else:
            ctx.holder = None
            assert mask is not None
            ctx.save_for_backward(pack_bits(mask))
        return x if inplace else out  # the very input object: what dynamo checks for mark_dirty

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        if ctx.holder is not None:
            output = ctx.holder.held_output()
            if output is not None:  # stock's own kernels on the very output: no mask built
                if ctx.slope == 0.0:
                    return torch.ops.aten.threshold_backward(grad, output, 0), None, None, None
                return (torch.ops.aten.leaky_relu_backward(grad, output, ctx.slope, True),
                        None, None, None)
            mask = ctx.holder.positive_mask()
        else:
            (packed,) = ctx.saved_tensors
            mask = unpack_bits(packed, ctx.shape)
        if ctx.slope == 0.0:
            return torch.where(mask, grad, 0), None, None, None
        return torch.where(mask, grad, grad * ctx.slope), None, None, None


def masked_leaky_relu(x: Tensor, slope: float = 0.0, inplace: bool = False) -> Tensor:
    """Leaky ReLU (ReLU for ``slope == 0``) keeping a 1-bit mask, or nothing new when the
    output is kept by someone else anyway (see :mod:`._holder`)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        if slope == 0.0:
            return F.relu(x, inplace=inplace)
        return F.leaky_relu(x, slope, inplace=inplace)
    _holder.compact()
    lazy = _holder.lazy_allowed()
    out = _MaskedLeakyReLU.apply(x, slope, inplace, lazy)
    if lazy and inplace and out.grad_fn.holder is not None:
        # apply() bumps the version of a tensor marked dirty after forward returns
        out.grad_fn.holder.version = out._version
    return out


class MemSaveReLU(nn.ReLU):
    """``nn.ReLU`` keeping ceil(N/8) bytes for backward (stock keeps the float output)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_leaky_relu(input, 0.0, self.inplace)


class MemSaveLeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` keeping ceil(N/8) bytes for backward (stock keeps the float input)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_leaky_relu(input, float(self.negative_slope), self.inplace)
