"""Batch norm that, in eval mode with a frozen scale, keeps one number per channel.

With running statistics the layer is affine per channel, ``y = x * scale + shift``, so the
input gradient needs only ``scale``; the input itself is needed only for the weight gradient.
Stock autograd keeps the whole input in every case. Training mode (batch statistics) needs the
input for the input gradient, so there and whenever the weight trains we run the stock path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._apply import apply


class _FrozenAffineBatchNorm(torch.autograd.Function):
    """Eval-mode batch norm for a frozen (or absent) weight: keeps the per-channel scale."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor,
        running_var: Tensor,
        eps: float,
    ) -> Tensor:
        invstd = 1.0 / torch.sqrt(running_var + eps)
        scale = invstd if weight is None else invstd * weight
        ctx.save_for_backward(scale)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (scale,) = ctx.saved_tensors
        need_x, _, need_b = ctx.needs_input_grad[:3]
        shape = [1, -1] + [1] * (grad.dim() - 2)
        grad_x = (grad * scale.view(shape)).to(grad.dtype) if need_x else None
        grad_b = None
        if need_b:
            dims = [0] + list(range(2, grad.dim()))
            acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
            grad_b = grad.sum(dims, dtype=acc).to(ctx.bias_dtype)
        return grad_x, None, grad_b, None, None, None


if TYPE_CHECKING:  # the mixin only ever sits before a batch norm class, which mypy should see
    _BatchNormBase = nn.modules.batchnorm._BatchNorm
else:
    _BatchNormBase = object


class _MemSaveBatchNormMixin(_BatchNormBase):
    """Runs :class:`_FrozenAffineBatchNorm` where it saves memory, the stock forward elsewhere."""

    def forward(self, input: Tensor) -> Tensor:
        mod: nn.modules.batchnorm._BatchNorm = self
        if mod.training:  # batch statistics: stock's path, before any parameter lookup (each
            return super().forward(input)  # goes through Module.__getattr__, per call)
        weight, bias = mod.weight, mod.bias
        use_running = not mod.training and mod.running_mean is not None and mod.running_var is not None
        grads = torch.is_grad_enabled() and (input.requires_grad or (bias is not None and bias.requires_grad))
        if use_running and grads and not (weight is not None and weight.requires_grad):
            mod._check_input_dim(input)
            _holder.compact(_holder.RECENT)
            out = apply(_FrozenAffineBatchNorm, input, weight, bias, mod.running_mean, mod.running_var, mod.eps)
            return out
        return super().forward(input)  # type: ignore[misc]


class MemSaveBatchNorm1d(_MemSaveBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` keeping only the per-channel scale in eval mode with a frozen weight."""


class MemSaveBatchNorm2d(_MemSaveBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` keeping only the per-channel scale in eval mode with a frozen weight."""


class MemSaveBatchNorm3d(_MemSaveBatchNormMixin, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` keeping only the per-channel scale in eval mode with a frozen weight."""
