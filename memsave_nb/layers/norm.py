"""RMSNorm keeping the input and one number per row when both input and weight train.

Stock ``F.rms_norm`` on the CPU is a composite of elementwise ops: with a trainable weight its
autograd keeps the input, the per-row ``rstd`` *and* the normalized input ``x * rstd`` (a
second full-size tensor) for the weight gradient. The normalized input is cheap to rebuild
from the input and ``rstd``, so we keep only those. In the other cases stock already keeps the
minimum (frozen weight: input and ``rstd``; frozen input: the normalized input) and runs as is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, shape: tuple[int, ...], eps: float | None) -> Tensor:
        dims = tuple(range(x.dim() - len(shape), x.dim()))
        # stock defaults eps to the machine epsilon of the compute (opmath) dtype
        eps_value = torch.finfo(_opmath(x.dtype)).eps if eps is None else eps
        xf = x.to(_opmath(x.dtype))
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True).add_(eps_value))  # (..., 1)
        del xf
        ctx.dims = dims
        ctx.eps = eps_value
        ctx.save_for_backward(x, weight, rstd)
        return F.rms_norm(x, shape, weight, eps)  # stock's own forward: identical output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        op = _opmath(x.dtype)
        if torch.is_grad_enabled():
            # create_graph: rstd depends on x, and the kept one was computed outside autograd;
            # rebuild it from x so that second-order gradients see that dependence
            rstd = torch.rsqrt(x.to(op).pow(2).mean(ctx.dims, keepdim=True) + ctx.eps)
        x_hat = x.to(op) * rstd
        g = grad.to(op)
        grad_w = None
        if need_w:
            lead = tuple(range(x.dim() - weight.dim()))
            grad_w = (g * x_hat).sum(lead).to(weight.dtype) if lead else (g * x_hat).to(weight.dtype)
        grad_x = None
        if need_x:
            gy = g * weight.to(op)
            proj = (gy * x_hat).mean(ctx.dims, keepdim=True)
            grad_x = ((gy - x_hat * proj) * rstd).to(x.dtype)
        return grad_x, grad_w, None, None


class MemSaveRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that does not keep the normalized input beside the input."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if torch.is_grad_enabled() and weight is not None and weight.requires_grad and x.requires_grad:
            _holder.compact(_holder.RECENT)
            return _RMSNorm.apply(x, weight, tuple(self.normalized_shape), self.eps)
        return super().forward(x)
