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
from ._apply import stock_refuses_inplace
from ._bits import numpy_ok, pack_bits, unpack_bits
from ._native import pack_nonzero, scale_bits

_FUSED_DEVICES = {"cuda", "xpu", "lazy", "privateuseone"}


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, inplace: bool) -> Tensor:
        ctx.shape = x.shape
        mask: Tensor | None  # None where the kernel packed the noise itself
        if x.device.type in _FUSED_DEVICES:
            out, mask = torch.native_dropout(x, p, True)  # what stock runs there
            ctx.fused = True
            if inplace:
                x.copy_(out)
                out = x
        else:
            noise = torch.empty_like(x).bernoulli_(1 - p)  # the stock CPU draw
            noise.div_(1 - p)
            ctx.fused = False
            out = x.mul_(noise) if inplace else x * noise
            # nonzero: kept; packed from the noise in one pass where the kernel runs
            packed = pack_nonzero(noise)
            mask = noise.bool() if packed is None else None  # (as != 0, in one fast cast)
        if inplace:
            ctx.mark_dirty(x)
        ctx.p = p
        ctx.save_for_backward(pack_bits(mask) if mask is not None else packed)
        return x if inplace else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (packed,) = ctx.saved_tensors
        if ctx.fused:  # stock's own backward kernel there
            mask = unpack_bits(packed, ctx.shape)
            return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1 - ctx.p)), None, None
        # grad * noise as stock, with noise = scale * mask; scale computed as forward did
        scale = torch.ones((), dtype=grad.dtype, device=grad.device).div_(1 - ctx.p)
        fused = _scaled(grad, packed, scale)
        if fused is not None:
            return fused, None, None
        mask = unpack_bits(packed, ctx.shape, torch.uint8).to(grad.dtype)  # same-dtype mul: fast
        return grad.mul(mask.mul_(scale)), None, None  # stock's noise, then stock's product


def _scaled(grad: Tensor, packed: Tensor, scale: Tensor) -> Tensor | None:
    """``grad * noise`` (noise: ``scale`` where the bit is set, 0 elsewhere) in one fused pass
    where the kernel runs, or None (plain CPU float32/64 gradients only: there ``scale`` is a
    real 0-d tensor whose value the kernel takes exactly)."""
    if grad.dtype not in (torch.float32, torch.float64) or not numpy_ok(scale):
        return None
    return scale_bits(grad, packed, scale.item(), 0.0)


def masked_dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """``F.dropout`` keeping a 1-bit mask; the trivial cases (eval, p in {0, 1}, no grad) are
    stock, where nothing or no mask is kept anyway."""
    if not (training and 0.0 < p < 1.0 and torch.is_grad_enabled() and x.requires_grad and x.numel() > 0) or (
        inplace and stock_refuses_inplace(x)
    ):
        return F.dropout(x, p, training, inplace)  # (an in-place op stock refuses: it raises)
    _holder.compact(_holder.RECENT)
    return _Dropout.apply(x, p, inplace)


class MemSaveDropout(nn.Dropout):
    """``nn.Dropout`` keeping ceil(N/8) bytes for backward."""

    def forward(self, input: Tensor) -> Tensor:
        return masked_dropout(input, self.p, self.training, self.inplace)


# SELU's alpha * scale, as in ATen's alpha dropout
_SELU_ALPHA = 1.7580993408473766


class _NoiseDropout(torch.autograd.Function):
    """Stock's composite dropouts (feature, alpha, feature alpha): ``y = x * noise (+ b)`` with
    ``noise = scale * bernoulli``; autograd keeps ``noise`` in float, backward needs its bits."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, feature: bool, alpha: bool, inplace: bool) -> Tensor:
        # the draw exactly as ATen's _dropout_impl makes it: same shape, same order
        if feature:
            noise = x.new_empty((x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2))
        else:
            noise = torch.empty_like(x)
        noise.bernoulli_(1 - p)
        packed = pack_nonzero(noise)  # nonzero: kept; one pass where the kernel runs
        mask = noise.bool() if packed is None else None  # (as != 0, in one fast cast)
        ctx.noise_shape = noise.shape
        shift = None
        if alpha:
            a = 1.0 / ((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p)) ** 0.5
            shift = noise.add(-1).mul_(_SELU_ALPHA * a).add_(_SELU_ALPHA * a * p)
            noise.mul_(a)
            ctx.scale = ("mul", a)
        else:
            noise.div_(1 - p)
            ctx.scale = ("div", 1 - p)
        out = x.mul_(noise) if inplace else x * noise
        del noise
        if shift is not None:
            out = out.add_(shift)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(pack_bits(mask) if mask is not None else packed)
        return x if inplace else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (packed,) = ctx.saved_tensors
        how, value = ctx.scale
        one = torch.ones((), dtype=grad.dtype, device=grad.device)
        scale = one.mul_(value) if how == "mul" else one.div_(value)  # as forward's noise
        if ctx.noise_shape == grad.shape:  # elementwise noise (not per channel)
            fused = _scaled(grad, packed, scale)
            if fused is not None:
                return fused, None, None, None, None
        mask = unpack_bits(packed, ctx.noise_shape, torch.uint8).to(grad.dtype)
        return grad.mul(mask.mul_(scale)), None, None, None, None  # as stock: grad * noise


def masked_noise_dropout(
    x: Tensor, p: float, training: bool, inplace: bool, feature: bool, alpha: bool
) -> Tensor | None:
    """Feature / alpha dropout keeping 1 bit per noise element, or None where stock keeps
    nothing (eval, p in {0, 1}, no gradient, empty input): the caller runs stock then."""
    if not (training and 0.0 < p < 1.0 and torch.is_grad_enabled() and x.requires_grad and x.numel() > 0) or (
        inplace and stock_refuses_inplace(x)
    ):
        return None  # (an in-place op stock refuses: stock's forward raises)
    _holder.compact(_holder.RECENT)
    return _NoiseDropout.apply(x, p, feature, alpha, inplace)


class _MemSaveFeatureDropoutMixin:
    """Channel dropout on batched input; unbatched input (stock keeps one float per channel
    there) and the trivial cases run the stock forward."""

    _batched_dim: int

    def forward(self, input: Tensor) -> Tensor:
        mod: Any = self
        out = None
        if input.dim() == self._batched_dim:
            out = masked_noise_dropout(input, mod.p, mod.training, mod.inplace, True, False)
        return super().forward(input) if out is None else out  # type: ignore[misc]


class MemSaveDropout1d(_MemSaveFeatureDropoutMixin, nn.Dropout1d):
    """``nn.Dropout1d`` keeping 1 bit per channel (stock: a float per channel)."""

    _batched_dim = 3


class MemSaveDropout2d(_MemSaveFeatureDropoutMixin, nn.Dropout2d):
    """``nn.Dropout2d`` keeping 1 bit per channel (stock: a float per channel)."""

    _batched_dim = 4


class MemSaveDropout3d(_MemSaveFeatureDropoutMixin, nn.Dropout3d):
    """``nn.Dropout3d`` keeping 1 bit per channel (stock: a float per channel)."""

    _batched_dim = 5


class MemSaveAlphaDropout(nn.AlphaDropout):
    """``nn.AlphaDropout`` keeping ceil(N/8) bytes (stock: the float noise, N floats)."""

    def forward(self, input: Tensor) -> Tensor:
        out = masked_noise_dropout(input, self.p, self.training, self.inplace, False, True)
        return super().forward(input) if out is None else out


class MemSaveFeatureAlphaDropout(nn.FeatureAlphaDropout):
    """``nn.FeatureAlphaDropout`` keeping 1 bit per channel (stock: a float per channel)."""

    def forward(self, input: Tensor) -> Tensor:
        out = None
        if input.dim() >= 2:
            out = masked_noise_dropout(input, self.p, self.training, self.inplace, True, True)
        return super().forward(input) if out is None else out
