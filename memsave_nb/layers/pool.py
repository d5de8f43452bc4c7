"""Max pooling that keeps the argmax as a small position inside its window.

Stock autograd keeps the input and int64 flat indices. Backward needs only where each
maximum sat: within a window of ``k`` elements that fits in uint8 when ``k <= 256``.
The input's shape suffices to scatter the gradient back.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder

_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _tuple(value: int | Sequence[int], n: int) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    return list(value)


def window_index_dtype(window_numel: int) -> torch.dtype:
    """Smallest integer dtype that indexes a window of ``window_numel`` elements."""
    if window_numel <= 256:
        return torch.uint8
    if window_numel <= 2**15:
        return torch.int16
    return torch.int32


def _window_starts(out_shape: Sequence[int], stride: list[int], padding: list[int], n: int,
                   device: torch.device) -> list[Tensor]:
    """Per spatial dim, the input coordinate where each output position's window starts,
    shaped to broadcast over the last ``n`` dims."""
    starts = []
    for d in range(n):
        view = [1] * n
        view[d] = out_shape[d]
        pos = torch.arange(out_shape[d], device=device) * stride[d] - padding[d]
        starts.append(pos.view(view))
    return starts


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, kernel: list[int], stride: list[int], padding: list[int],
                dilation: list[int], ceil_mode: bool) -> Tensor:
        n = len(kernel)
        out, flat = _POOL[n](x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        in_spatial = x.shape[-n:]
        starts = _window_starts(out.shape[-n:], stride, padding, n, x.device)
        # flat index -> per-dim coordinate -> offset inside the window (row-major over kernel)
        local = torch.zeros_like(flat)
        rest = flat
        coords = []
        for d in reversed(range(n)):
            coords.append(rest % in_spatial[d])
            rest = rest // in_spatial[d]
        coords.reverse()
        for d in range(n):
            local = local * kernel[d] + (coords[d] - starts[d]) // dilation[d]
        window = 1
        for k in kernel:
            window *= k
        ctx.save_for_backward(local.to(window_index_dtype(window)))
        ctx.params = (kernel, stride, padding, dilation)
        ctx.x_shape = x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation = ctx.params
        n = len(kernel)
        in_spatial = ctx.x_shape[-n:]
        starts = _window_starts(grad.shape[-n:], stride, padding, n, grad.device)
        # window offset -> flat input index, in place on two int64 temporaries
        rest = local.long()
        flat: Tensor | None = None
        for d in reversed(range(n)):
            if d > 0:
                coord = rest % kernel[d]
                rest.div_(kernel[d], rounding_mode="floor")
            else:
                coord = rest
            coord.mul_(dilation[d]).add_(starts[d])  # input coordinate along dim d
            if flat is None:
                flat = coord
            else:
                stride_d = 1
                for s in in_spatial[d + 1:]:
                    stride_d *= s
                flat.add_(coord.mul_(stride_d))
                del coord
        assert flat is not None
        lead = ctx.x_shape[:-n]
        spatial_numel = 1
        for s in in_spatial:
            spatial_numel *= s
        grad_x = grad.new_zeros((*lead, spatial_numel))
        grad_x.scatter_add_(-1, flat.reshape(*lead, -1), grad.reshape(*lead, -1))
        return grad_x.view(ctx.x_shape), None, None, None, None, None


def max_pool(x: Tensor, n: int, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None,
             padding: int | Sequence[int], dilation: int | Sequence[int], ceil_mode: bool) -> Tensor:
    """N-d max pooling keeping window-local argmax positions in the smallest integer type."""
    kernel = _tuple(kernel_size, n)
    stride_l = kernel if (stride is None or stride == [] or stride == ()) else _tuple(stride, n)
    padding_l, dilation_l = _tuple(padding, n), _tuple(dilation, n)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _POOL[n](x, kernel, stride_l, padding_l, dilation_l, ceil_mode)
    _holder.compact()
    return _MaxPool.apply(x, kernel, stride_l, padding_l, dilation_l, ceil_mode)


class _MemSaveMaxPoolMixin:
    _n: int

    def forward(self, input: Tensor) -> Tensor:
        mod: Any = self
        if mod.return_indices:
            return super().forward(input)  # type: ignore[misc]
        return max_pool(input, self._n, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                        mod.ceil_mode)


class MemSaveMaxPool1d(_MemSaveMaxPoolMixin, nn.MaxPool1d):
    """``nn.MaxPool1d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 1


class MemSaveMaxPool2d(_MemSaveMaxPoolMixin, nn.MaxPool2d):
    """``nn.MaxPool2d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 2


class MemSaveMaxPool3d(_MemSaveMaxPoolMixin, nn.MaxPool3d):
    """``nn.MaxPool3d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 3
