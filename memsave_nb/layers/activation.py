"""ReLU and LeakyReLU that keep 1 bit per element for backward instead of a float tensor."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._apply import apply, stock_refuses_inplace
from ._bits import pack_bits, pack_inside, positive, unpack_bits
from ._native import pack_nonzero, pack_positive, relu_pack, scale_bits, select_bits


class _MaskedLeakyReLU(torch.autograd.Function):
    """``y = x if x > 0 else slope * x`` (``slope=None``: ReLU); backward needs only a mask."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, slope: float | None, inplace: bool, lazy: bool, key: object = None) -> Tensor:
        ctx.slope = slope
        ctx.shape = x.shape
        # With slope < 0 the output's sign no longer tells the input's: mask from the input.
        lazy = lazy and (slope is None or slope > 0)
        # the mask is packed now where it is saved now, or where this layer's output was left
        # to its holder alone last step (packed beside the held output, while it is cached)
        early = lazy and _holder.pack_early(key)
        # Leaky: the input's sign, taken before an in-place op. ReLU: from the output below,
        # ``out != 0``, which lets NaN through as stock's ``not (out <= 0)`` does.
        leaky_bits = pack_positive(x) if (not lazy and slope is not None) else None  # one pass
        mask = positive(x) if (not lazy and slope is not None and leaky_bits is None) else None
        fused = None
        if slope is None:
            # the mask is packed now: ReLU and packing in one pass, where the kernel runs
            fused = relu_pack(x, inplace) if (early or not lazy) else None
            if fused is not None:
                out = fused[0]
            else:
                out = torch.relu_(x) if inplace else torch.relu(x)
        else:
            out = F.leaky_relu_(x, slope) if inplace else F.leaky_relu(x, slope)
        if inplace:
            ctx.mark_dirty(x)
        if lazy:
            holder = _holder.OutputHolder(out, relu=slope is None, key=key)
            if fused is not None:
                holder.packed = fused[1]  # what pack_now would pack, from the same pass
            elif early:
                holder.pack_now()  # while the output is in the cache
            ctx.holder = holder
            _holder.register(holder)
            ctx.save_for_backward()
        else:
            ctx.holder = None
            packed: Tensor | None
            if fused is not None:
                packed = fused[1]
            elif leaky_bits is not None:
                packed = leaky_bits
            else:
                packed = pack_nonzero(out) if mask is None else None  # fused, where it runs
            if packed is None:
                packed = pack_bits(out.bool() if mask is None else mask)
            ctx.save_for_backward(packed)
        return x if inplace else out  # the very input object: what dynamo checks for mark_dirty

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        holder = ctx.holder
        if holder is not None:
            output = holder.held_output()
            packed = holder.packed_mask() if output is None else None
            if not torch._C._autograd._get_current_graph_task_keep_graph():
                # free it now, as autograd frees saved tensors (no retain_graph)
                ctx.holder = None
                holder.release()
            if output is not None:  # stock's own kernels on the very output: no mask built
                if ctx.slope is None:
                    return (torch.ops.aten.threshold_backward(grad, output, 0), None, None, None, None)
                return (torch.ops.aten.leaky_relu_backward(grad, output, ctx.slope, True), None, None, None, None)
            assert packed is not None  # the output was dropped: packed_mask() gave the mask
        else:
            (packed,) = ctx.saved_tensors
        # one fused pass, where it runs
        fused = select_bits(grad, packed) if ctx.slope is None else scale_bits(grad, packed, 1.0, ctx.slope)
        if fused is not None:
            return fused, None, None, None, None
        # stock's kernels read a 0/1 mask as the (output > 0) test they normally do; in the
        # gradient's dtype, as they would promote it anyway (mixed dtypes run ~3x slower)
        mask = unpack_bits(packed, ctx.shape, torch.uint8).to(grad.dtype)
        if ctx.slope is None:
            return torch.ops.aten.threshold_backward(grad, mask, 0), None, None, None, None
        return (torch.ops.aten.leaky_relu_backward(grad, mask, ctx.slope, False), None, None, None, None)


def masked_leaky_relu(x: Tensor, slope: float | None = None, inplace: bool = False, key: object = None) -> Tensor:
    """Leaky ReLU (ReLU for ``slope=None``) keeping a 1-bit mask, or nothing new when the
    output is kept by someone else anyway (see :mod:`._holder`; ``key``, the layer, lets it
    pack the mask early where that layer's output was left to it last time)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or (
        inplace and stock_refuses_inplace(x)
    ):  # stock raises, before changing x
        if slope is None:
            return F.relu(x, inplace=inplace)
        return F.leaky_relu(x, slope, inplace=inplace)
    lazy = _holder.begin_layer()
    out = apply(_MaskedLeakyReLU, x, slope, inplace, lazy, key if lazy else None)
    if lazy and inplace and out.grad_fn.holder is not None:
        # apply() bumps the version of a tensor marked dirty after forward returns
        out.grad_fn.holder.version = out._version
    return out


class MemSaveReLU(nn.ReLU):
    """``nn.ReLU`` keeping ceil(N/8) bytes for backward (stock keeps the float output)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_leaky_relu(input, None, self.inplace, self)


class MemSaveLeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` keeping ceil(N/8) bytes for backward (stock keeps the float input)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_leaky_relu(input, float(self.negative_slope), self.inplace, self)


class _MaskedHardtanh(torch.autograd.Function):
    """``y = clamp(x, low, high)``; backward needs only where ``low < x < high``: a mask."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, low: float, high: float, inplace: bool, lazy: bool, key: object = None) -> Tensor:
        ctx.bounds = (low, high)
        ctx.shape = x.shape
        out = torch._C._nn.hardtanh_(x, low, high) if inplace else torch._C._nn.hardtanh(x, low, high)
        if inplace:
            ctx.mark_dirty(x)
        if lazy:
            holder = _holder.OutputHolder(out, relu=False, bounds=(low, high), key=key)
            if _holder.pack_early(key):
                holder.pack_now()  # while the output is in the cache
            ctx.holder = holder
            _holder.register(holder)
            ctx.save_for_backward()
        else:
            ctx.holder = None
            # inside exactly where the input was (low < high)
            packed = pack_inside(out, low, high)
            if packed is None:
                packed = pack_bits(_holder.inside_mask(out, low, high))
            ctx.save_for_backward(packed)
        return x if inplace else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None, None]:
        low, high = ctx.bounds
        holder = ctx.holder
        if holder is not None:
            output = holder.held_output()
            packed = holder.packed_mask() if output is None else None
            if not torch._C._autograd._get_current_graph_task_keep_graph():
                ctx.holder = None
                holder.release()
            if output is not None:  # stock's kernel on the very output
                return (torch.ops.aten.hardtanh_backward(grad, output, low, high), None, None, None, None, None)
            assert packed is not None  # the output was dropped: packed_mask() gave the mask
        else:
            (packed,) = ctx.saved_tensors
        selected = select_bits(grad, packed)  # one fused pass, where it runs
        if selected is not None:
            return selected, None, None, None, None, None
        # a 0/1 mask through stock's ReLU kernel: grad where 1, exact zeros elsewhere
        mask = unpack_bits(packed, ctx.shape, torch.uint8)
        return (torch.ops.aten.threshold_backward(grad, mask.to(grad.dtype), 0), None, None, None, None, None)


def masked_hardtanh(
    x: Tensor, low: float = -1.0, high: float = 1.0, inplace: bool = False, key: object = None
) -> Tensor:
    """Hardtanh (ReLU6 for 0, 6) keeping a 1-bit mask of the linear region, or nothing new
    when the output is kept by someone else anyway (see :mod:`._holder`)."""
    if not (torch.is_grad_enabled() and x.requires_grad) or (
        inplace and stock_refuses_inplace(x)
    ):  # stock raises, before changing x
        return F.hardtanh(x, low, high, inplace)
    lazy = _holder.begin_layer()
    out = apply(_MaskedHardtanh, x, float(low), float(high), inplace, lazy, key if lazy else None)
    if lazy and inplace and out.grad_fn.holder is not None:
        out.grad_fn.holder.version = out._version
    return out


class MemSaveHardtanh(nn.Hardtanh):
    """``nn.Hardtanh`` keeping ceil(N/8) bytes for backward (stock keeps the float input)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_hardtanh(input, self.min_val, self.max_val, self.inplace, self)


class MemSaveReLU6(nn.ReLU6):
    """``nn.ReLU6`` keeping ceil(N/8) bytes for backward (stock keeps the float input)."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_hardtanh(input, self.min_val, self.max_val, self.inplace, self)
