"""Convolutions (1d/2d/3d, plain and transposed) that keep only what backward will use.

Stock autograd keeps both the input and the weight whenever any of them needs a gradient.
The input is needed only for the weight gradient and the weight only for the input gradient,
so one N-d autograd Function decides from ``ctx.needs_input_grad`` at forward time. It runs
only for a frozen weight: with a trainable one stock keeps the minimum already.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._apply import apply


def _tuple(value: int | Sequence[int], n: int) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    return list(value)


class _Convolution(torch.autograd.Function):
    """``aten.convolution`` whose backward runs ``aten.convolution_backward`` with an output
    mask and a shape-only stand-in (an expanded one-element tensor) for what was not kept."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        transposed: bool,
        output_padding: list[int],
        groups: int,
    ) -> Tensor:
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.params = (stride, padding, dilation, transposed, output_padding, groups)
        ctx.x_shape = x.shape
        ctx.w_shape = weight.shape
        ctx.x_channels_last = _channels_last(x)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        return torch.convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.bias_sizes is not None
        x, weight = ctx.saved_tensors
        stride, padding, dilation, transposed, output_padding, groups = ctx.params
        grad_x = grad_w = grad_b = None
        if need_x and not need_w:
            # The input gradient alone is the adjoint convolution run forward: as fast as
            # stock's backward kernel, and it needs no stand-in for the input.
            grad_x = _adjoint(grad, weight, ctx.x_shape, stride, padding, dilation, transposed, output_padding, groups)
        if (need_x and grad_x is None) or need_w or need_b:
            if x is None:
                x = grad.new_empty(1).expand(ctx.x_shape)  # shape only: not read
            if weight is None:
                weight = grad.new_empty(1).expand(ctx.w_shape)
            mask = [need_x and grad_x is None, need_w, need_b]
            gx, grad_w, grad_b = torch.ops.aten.convolution_backward(
                grad,
                x,
                weight,
                ctx.bias_sizes,
                stride,
                padding,
                dilation,
                transposed,
                output_padding,
                groups,
                mask,
            )
            if mask[0]:
                grad_x = gx
        if grad_x is not None and ctx.x_channels_last and not _channels_last(grad_x):
            # give the gradient the input's layout, as stock does
            grad_x = grad_x.contiguous(memory_format=_layout(grad_x))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _adjoint(
    grad: Tensor,
    weight: Tensor,
    x_shape: torch.Size,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: bool,
    output_padding: list[int],
    groups: int,
) -> Tensor | None:
    """Input gradient of a (transposed) convolution as the forward of its adjoint, or None
    when the adjoint cannot reproduce the input size (then the caller uses the backward op)."""
    n = len(stride)
    k = weight.shape[2:]
    out = grad.shape[2:]
    if (
        groups == 1
        and all(size == 1 for size in k)
        and not any(padding)
        and (not transposed or (all(s == 1 for s in stride) and not any(output_padding)))
    ):
        return _pointwise_adjoint(grad, weight, x_shape, stride, transposed)
    if transposed:
        # the adjoint is a plain convolution; it lands on the input size iff output_padding < stride
        if any(op >= s for op, s in zip(output_padding, stride)):
            return None
        return torch.convolution(grad, weight, None, stride, padding, dilation, False, [0] * n, groups)
    extra = [
        x_shape[2 + d] - ((out[d] - 1) * stride[d] - 2 * padding[d] + dilation[d] * (k[d] - 1) + 1) for d in range(n)
    ]
    if any(e < 0 or e >= max(stride[d], dilation[d]) for d, e in enumerate(extra)):
        return None
    return torch.convolution(grad, weight, None, stride, padding, dilation, True, extra, groups)


def _pointwise_adjoint(
    grad: Tensor, weight: Tensor, x_shape: torch.Size, stride: list[int], transposed: bool
) -> Tensor:
    """1x1 convolution's input gradient as one matmul (faster here than the convolution
    kernels, which pick slow paths for channel-reducing 1x1s); strided: into every s-th pixel."""
    batch, c_out = grad.shape[:2]
    c_in = x_shape[1]
    w2d = weight.reshape(weight.shape[0], weight.shape[1])  # (out, in) or (in, out) transposed
    w_t = w2d if transposed else w2d.t()  # (in, out)
    prod = torch.matmul(w_t, grad.reshape(batch, c_out, -1))  # (B, in, L_out)
    if all(s == 1 for s in stride):
        return prod.view(x_shape)
    grad_x = grad.new_zeros(x_shape)
    index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)
    grad_x[index] = prod.view(batch, c_in, *grad.shape[2:])
    return grad_x


def _channels_last(x: Tensor) -> bool:
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return False


def _layout(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def convolution(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int] | str,
    dilation: Sequence[int],
    groups: int,
    transposed: bool = False,
    output_padding: Sequence[int] | None = None,
) -> Tensor:
    """N-d (transposed) convolution keeping the input only for the weight gradient and the
    weight only for the input gradient. Accepts unbatched input and 'same'/'valid' padding."""
    n = weight.dim() - 2
    stride_l, dilation_l = _tuple(stride, n), _tuple(dilation, n)
    unbatched = x.dim() == n + 1
    if unbatched:
        x = x.unsqueeze(0)
    if isinstance(padding, str):
        x, padding_l = _string_padding(x, padding, weight.shape[2:], dilation_l)
    else:
        padding_l = _tuple(padding, n)
    out_pad = [0] * n if output_padding is None else _tuple(output_padding, n)
    bias_grad = bias is not None and bias.requires_grad
    if (
        torch.is_grad_enabled()
        and not weight.requires_grad
        and (x.requires_grad or bias_grad)
        and x.shape[2:].numel() != 1
    ):
        # (A 1x1 feature map, as squeeze-excite's pooled vector, runs stock below: stock keeps
        # N x C numbers there, less than our Function's per-call cost is worth.)
        # Only with a frozen weight does stock keep more than needed (the input); with a
        # trainable weight it keeps the input and the weight (a parameter), the minimum,
        # so stock's op runs then and costs nothing extra.
        _holder.compact(_holder.RECENT)
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # cast as autocast casts convolutions, so that what is kept and what backward
            # computes with share one dtype (backward runs outside autocast)
            low = torch.get_autocast_dtype(device)
            x, weight = x.to(low), weight.to(low)
            bias = None if bias is None else bias.to(low)
        out = apply(_Convolution, x, weight, bias, stride_l, padding_l, dilation_l, transposed, out_pad, groups)
    elif transposed:  # the stock functionals: autocast wraps them (not aten.convolution)
        out = _CONV_T[n](x, weight, bias, stride_l, padding_l, out_pad, groups, dilation_l)
    else:
        out = _CONV[n](x, weight, bias, stride_l, padding_l, dilation_l, groups)
    return out.squeeze(0) if unbatched else out


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _string_padding(x: Tensor, padding: str, kernel: Sequence[int], dilation: list[int]) -> tuple[Tensor, list[int]]:
    """Explicit padding for 'valid'/'same'; odd totals pad one extra on the right, as stock."""
    n = len(kernel)
    if padding == "valid":
        return x, [0] * n
    if padding != "same":
        raise ValueError(f"invalid padding string {padding!r}, expected 'same' or 'valid'")
    left, extra = [], []
    for k, d in zip(kernel, dilation):
        total = d * (k - 1)
        left.append(total // 2)
        extra.append(total - 2 * (total // 2))
    if any(extra):
        pad: list[int] = []
        for e in reversed(extra):
            pad += [0, e]
        x = F.pad(x, pad)
    return x, left


class _MemSaveConvMixin:
    """Replaces the stock ``F.convNd`` call; the stock forward still does padding modes."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.padding_mode != "zeros":  # type: ignore[attr-defined]
            input = F.pad(
                input,
                self._reversed_padding_repeated_twice,  # type: ignore[attr-defined]
                mode=self.padding_mode,  # type: ignore[attr-defined]
            )
            padding: Sequence[int] | str = [0] * (weight.dim() - 2)
        else:
            padding = self.padding  # type: ignore[attr-defined]
        return convolution(
            input,
            weight,
            bias,
            self.stride,  # type: ignore[attr-defined]
            padding,
            self.dilation,  # type: ignore[attr-defined]
            self.groups,  # type: ignore[attr-defined]
        )


class MemSaveConv1d(_MemSaveConvMixin, nn.Conv1d):
    """``nn.Conv1d`` keeping the input only if the weight needs a gradient, and vice versa."""


class MemSaveConv2d(_MemSaveConvMixin, nn.Conv2d):
    """``nn.Conv2d`` keeping the input only if the weight needs a gradient, and vice versa."""


class MemSaveConv3d(_MemSaveConvMixin, nn.Conv3d):
    """``nn.Conv3d`` keeping the input only if the weight needs a gradient, and vice versa."""


class _MemSaveConvTransposeMixin:
    """The stock transposed forward (output_size to output_padding) with our Function."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if self.padding_mode != "zeros":  # type: ignore[attr-defined]
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__mro__[2].__name__}")
        n = self.weight.dim() - 2  # type: ignore[attr-defined]
        output_padding = self._output_padding(  # type: ignore[attr-defined]
            input,
            output_size,
            self.stride,  # type: ignore[attr-defined]
            self.padding,  # type: ignore[attr-defined]
            self.kernel_size,  # type: ignore[attr-defined]
            n,
            self.dilation,  # type: ignore[attr-defined]
        )
        return convolution(
            input,
            self.weight,  # type: ignore[attr-defined]
            self.bias,  # type: ignore[attr-defined]
            self.stride,  # type: ignore[attr-defined]
            self.padding,  # type: ignore[attr-defined]
            self.dilation,  # type: ignore[attr-defined]
            self.groups,  # type: ignore[attr-defined]
            transposed=True,
            output_padding=output_padding,
        )


class MemSaveConvTranspose1d(_MemSaveConvTransposeMixin, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` keeping the input only if the weight needs a gradient, and vice versa."""


class MemSaveConvTranspose2d(_MemSaveConvTransposeMixin, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` keeping the input only if the weight needs a gradient, and vice versa."""


class MemSaveConvTranspose3d(_MemSaveConvTransposeMixin, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` keeping the input only if the weight needs a gradient, and vice versa."""
