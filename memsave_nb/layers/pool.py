"""Max pooling that keeps the argmax as a small position inside its window.

Stock autograd keeps the input and int64 flat indices. Backward needs only where each
maximum sat: within a window of ``k`` elements that fits in uint8 when ``k <= 256``.
Forward turns stock's flat indices into window offsets (one table lookup); backward turns
them back and runs stock's backward kernel, for which the input's shape is enough.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _holder
from ._native import pool_flat, pool_offsets

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


def _window_starts(
    out_shape: Sequence[int], stride: list[int], padding: list[int], n: int, device: torch.device
) -> list[Tensor]:
    """Per spatial dim, the input coordinate where each output position's window starts,
    shaped to broadcast over the last ``n`` dims."""
    starts = []
    for d in range(n):
        view = [1] * n
        view[d] = out_shape[d]
        pos = torch.arange(out_shape[d], device=device) * stride[d] - padding[d]
        starts.append(pos.view(view))
    return starts


def _window_base(
    out_spatial: Sequence[int], in_spatial: Sequence[int], stride: list[int], padding: list[int], device: torch.device
) -> Tensor:
    """Flat input index of each window's first element (it may lie in the padding)."""
    n = len(in_spatial)
    starts = _window_starts(out_spatial, stride, padding, n, device)
    base = starts[n - 1]
    step = 1
    for d in reversed(range(n - 1)):
        step *= in_spatial[d + 1]
        base = base + starts[d] * step
    return base


def _kernel_deltas(in_spatial: Sequence[int], kernel: list[int], dilation: list[int]) -> list[int] | None:
    """Flat-index distance from a window's first element to each kernel position (row-major),
    or None when two positions share a distance (a window wider than the input) or the
    lookup table would be large: then offsets are computed by division instead."""
    deltas = [0]
    step = 1
    steps = []
    for d in reversed(range(len(kernel))):
        steps.append(step)
        step *= in_spatial[d]
    steps.reverse()
    for k, dil, st in zip(kernel, dilation, steps):
        deltas = [base + i * dil * st for base in deltas for i in range(k)]
    if len(set(deltas)) != len(deltas) or len(deltas) > 4096 or max(deltas) >= 1 << 20:
        return None
    return deltas


# int64 index temporaries are bounded by working through the batch in chunks of this many
# output elements (32 MiB of int64; stock keeps int64 indices of the full output), so
# pooling never needs a huge int64 temporary.
_CHUNK_NUMEL = 1 << 22


def _chunks(batch: int, per_sample: int) -> list[tuple[int, int]]:
    if batch == 0:
        return [(0, 0)]  # an empty batch still runs (stock does), as one empty chunk
    step = max(1, _CHUNK_NUMEL // max(1, per_sample))
    return [(i, min(batch, i + step)) for i in range(0, batch, step)]


def _window_offsets(
    flat: Tensor,
    out_spatial: Sequence[int],
    in_spatial: Sequence[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    dtype: torch.dtype,
    inplace: bool = True,
) -> Tensor:
    """Flat input indices (consumed in place unless ``inplace=False``: then no tensor is
    changed in place, as a SAC region requires) -> row-major offsets inside each window."""
    n = len(kernel)
    starts = _window_starts(out_spatial, stride, padding, n, flat.device)
    local: Tensor | None = None
    mult = 1
    for d in reversed(range(n)):
        if d > 0:
            coord = flat % in_spatial[d]
            flat = (flat.div_ if inplace else flat.div)(in_spatial[d], rounding_mode="floor")
        else:
            coord = flat
        if inplace:
            coord.sub_(starts[d]).div_(dilation[d], rounding_mode="floor")  # offset along d
            if mult != 1:
                coord.mul_(mult)
            local = coord if local is None else local.add_(coord)
        else:
            coord = (coord - starts[d]).div(dilation[d], rounding_mode="floor") * mult
            local = coord if local is None else local + coord
        mult *= kernel[d]
    assert local is not None
    return local.to(dtype)


def _flat_indices(
    local: Tensor,
    out_spatial: Sequence[int],
    in_spatial: Sequence[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> Tensor:
    """Window offsets -> flat int64 input indices, on two int64 temporaries."""
    n = len(kernel)
    starts = _window_starts(out_spatial, stride, padding, n, local.device)
    rest = local.long()
    flat: Tensor | None = None
    step = 1
    for d in reversed(range(n)):
        if d > 0:
            coord = rest % kernel[d]
            rest.div_(kernel[d], rounding_mode="floor")
        else:
            coord = rest
        coord.mul_(dilation[d]).add_(starts[d])  # input coordinate along dim d
        if step != 1:
            coord.mul_(step)
        flat = coord if flat is None else flat.add_(coord)
        step *= in_spatial[d]
    assert flat is not None
    return flat


class _MaxPool(torch.autograd.Function):
    """Max pooling keeping only the argmax offset inside its window."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        ceil_mode: bool,
    ) -> Tensor:
        n = len(kernel)
        window = 1
        for k in kernel:
            window *= k
        dtype = window_index_dtype(window)
        in_spatial = x.shape[-n:]
        pool = _POOL[n]
        deltas = _kernel_deltas(in_spatial, kernel, dilation)
        tables: list[Tensor] = []  # the torch path's lookup table, made when first needed

        def lookup() -> Tensor:  # delta -> window offset by one lookup, no integer division
            assert deltas is not None  # called only where the deltas were found
            if not tables:
                # built out of place: inside a SAC region every op output may be cached
                tables.append(
                    torch.zeros(max(deltas) + 1, dtype=dtype, device=x.device).index_put(
                        (torch.tensor(deltas, device=x.device),), torch.arange(len(deltas), device=x.device).to(dtype)
                    )
                )
            return tables[0]

        # Under saved-tensor hooks (checkpointing, SAC) the pool's indices may sit in SAC's
        # cache, which refuses tensors changed in place: work on a copy there.
        own_indices = _holder.lazy_allowed()

        def offsets(flat: Tensor, out_spatial: Sequence[int]) -> Tensor:
            local = pool_offsets(
                flat, out_spatial, in_spatial, stride, padding, deltas, dtype
            )  # one C pass, where it runs
            if local is not None:
                return local
            if deltas is None:
                return _window_offsets(
                    flat, out_spatial, in_spatial, kernel, stride, padding, dilation, dtype, own_indices
                )
            base = _window_base(out_spatial, in_spatial, stride, padding, flat.device)
            flat = flat.sub_(base) if own_indices else flat.sub(base)
            return lookup().index_select(0, flat.reshape(-1)).view(flat.shape)

        if x.dim() == n + 1:  # unbatched: one chunk
            out, flat = pool(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
            local = offsets(flat, out.shape[-n:])
        else:
            out_chunks, local_chunks = [], []
            per_sample = x.shape[1:].numel()
            for lo, hi in _chunks(x.shape[0], per_sample):
                o, flat = pool(x[lo:hi], kernel, stride, padding, dilation, ceil_mode, return_indices=True)
                local_chunks.append(offsets(flat, o.shape[-n:]))
                out_chunks.append(o)
                del flat
            if len(out_chunks) == 1:
                out, local = out_chunks[0], local_chunks[0]
            else:
                out = _cat(out_chunks) if own_indices else torch.cat(out_chunks)
                local = torch.cat(local_chunks)
        ctx.save_for_backward(local)
        ctx.params = (kernel, stride, padding, dilation, ceil_mode)
        ctx.deltas = deltas
        ctx.x_shape = x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.params
        n = len(kernel)
        x_shape = ctx.x_shape
        in_spatial = x_shape[-n:]
        deltas_t = None  # the torch path's delta table, made when first needed
        # create_graph: one differentiable (not out=) call over the whole batch
        differentiable = torch.is_grad_enabled()
        grad_x = grad.new_empty(x_shape)
        if len(x_shape) == n + 1 or differentiable:
            spans: list[tuple[int | None, int | None]] = [(None, None)]
        else:
            spans = list(_chunks(x_shape[0], grad.shape[1:].numel()))
        for lo, hi in spans:
            g, loc, gx = grad[lo:hi], local[lo:hi], grad_x[lo:hi]
            flat = pool_flat(loc, g.shape[-n:], in_spatial, stride, padding, ctx.deltas)  # one C pass, where it runs
            if flat is None and ctx.deltas is None:
                flat = _flat_indices(loc, g.shape[-n:], in_spatial, kernel, stride, padding, dilation)
            elif flat is None:
                if deltas_t is None:
                    deltas_t = torch.tensor(ctx.deltas, dtype=torch.int64, device=grad.device)
                flat = deltas_t.index_select(0, loc.reshape(-1).int()).view(loc.shape)
                flat.add_(_window_base(g.shape[-n:], in_spatial, stride, padding, g.device))
            if differentiable:
                grad_x = _stock_backward(g, None, flat, kernel, stride, padding, dilation, ceil_mode, x_shape)
            else:
                _stock_backward(g, gx, flat, kernel, stride, padding, dilation, ceil_mode)
            del flat
        return grad_x, None, None, None, None, None


def _stock_backward(
    grad: Tensor,
    grad_x: Tensor | None,
    flat: Tensor,
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
    x_shape: Sequence[int] | None = None,
) -> Tensor:
    """Stock's max-pool backward kernel, writing into ``grad_x`` (which it zero-fills), or,
    with ``grad_x=None``, returning a new (differentiable) gradient of shape ``x_shape``; the
    input it asks for only lends its shape, so a one-element stand-in serves."""
    shape = list(grad_x.shape) if grad_x is not None else list(x_shape or [])
    one_d = len(kernel) == 1
    if one_d:  # 1d runs as 2d over a height of one
        grad, flat = grad.unsqueeze(-2), flat.unsqueeze(-2)
        grad_x = None if grad_x is None else grad_x.unsqueeze(-2)
        shape = [*shape[:-1], 1, shape[-1]]
        kernel, stride = [1, *kernel], [1, *stride]
        padding, dilation = [0, *padding], [1, *dilation]
    backward = (
        torch.ops.aten.max_pool2d_with_indices_backward
        if len(kernel) == 2
        else torch.ops.aten.max_pool3d_with_indices_backward
    )
    stand_in = grad.new_empty(1).expand(shape)
    if grad_x is not None:
        backward.grad_input(grad, stand_in, kernel, stride, padding, dilation, ceil_mode, flat, grad_input=grad_x)
        return grad_x
    out = backward.default(grad, stand_in, kernel, stride, padding, dilation, ceil_mode, flat)
    return out.squeeze(-2) if one_d else out


def _cat(chunks: list[Tensor]) -> Tensor:
    """Concatenate along the batch keeping the chunks' memory format (cat may not)."""
    first = chunks[0]
    shape = (sum(c.shape[0] for c in chunks), *first.shape[1:])
    fmt = torch.preserve_format
    if first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last):
        fmt = torch.channels_last
    elif first.dim() == 5 and first.is_contiguous(memory_format=torch.channels_last_3d):
        fmt = torch.channels_last_3d
    out = first.new_empty(shape)
    if fmt is not torch.preserve_format:
        out = out.contiguous(memory_format=fmt)
    lo = 0
    for c in chunks:
        out[lo : lo + c.shape[0]].copy_(c)
        lo += c.shape[0]
    return out


def max_pool(
    x: Tensor,
    n: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None,
    padding: int | Sequence[int],
    dilation: int | Sequence[int],
    ceil_mode: bool,
) -> Tensor:
    """N-d max pooling keeping window-local argmax positions in the smallest integer type."""
    kernel = _tuple(kernel_size, n)
    stride_l = kernel if (stride is None or stride == [] or stride == ()) else _tuple(stride, n)
    padding_l, dilation_l = _tuple(padding, n), _tuple(dilation, n)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _POOL[n](x, kernel, stride_l, padding_l, dilation_l, ceil_mode)
    _holder.compact(_holder.RECENT)
    return _MaxPool.apply(x, kernel, stride_l, padding_l, dilation_l, ceil_mode)


class _MemSaveMaxPoolMixin:
    _n: int

    def forward(self, input: Tensor) -> Tensor:
        mod: Any = self
        if mod.return_indices:
            return super().forward(input)  # type: ignore[misc]
        return max_pool(input, self._n, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.ceil_mode)


class MemSaveMaxPool1d(_MemSaveMaxPoolMixin, nn.MaxPool1d):
    """``nn.MaxPool1d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 1


class MemSaveMaxPool2d(_MemSaveMaxPoolMixin, nn.MaxPool2d):
    """``nn.MaxPool2d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 2


class MemSaveMaxPool3d(_MemSaveMaxPoolMixin, nn.MaxPool3d):
    """``nn.MaxPool3d`` keeping a window-local argmax (uint8 for windows up to 256)."""

    _n = 3


# -- adaptive max pooling ------------------------------------------------------------------
_ADAPTIVE = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


def _adaptive_windows(in_size: int, out_size: int) -> tuple[list[int], int]:
    """Window starts along one dim (as ATen: floor(o * in / out)) and the widest window."""
    starts = [(o * in_size) // out_size for o in range(out_size)]
    ends = [-(-((o + 1) * in_size) // out_size) for o in range(out_size)]
    return starts, max((e - s for s, e in zip(starts, ends)), default=1)


class _AdaptiveMaxPool(torch.autograd.Function):
    """Adaptive max pooling keeping only the argmax offset inside its (variable) window."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output_size: Any, n: int) -> Tensor:
        out, flat = _ADAPTIVE[n](x, output_size, return_indices=True)
        in_spatial, out_spatial = list(x.shape[-n:]), list(out.shape[-n:])
        starts, widths = [], []
        for d in range(n):
            s, w = _adaptive_windows(in_spatial[d], out_spatial[d])
            view = [1] * n
            view[d] = out_spatial[d]
            starts.append(torch.tensor(s, device=x.device).view(view))
            widths.append(w)
        window = 1
        for w in widths:
            window *= w
        # window offset = row-major position inside a (widths) box; out of place throughout
        # (inside a SAC region every op output may be cached)
        local: Tensor | None = None
        rest = flat
        mult = 1
        for d in reversed(range(n)):
            coord = rest % in_spatial[d] if d > 0 else rest
            if d > 0:
                rest = rest.div(in_spatial[d], rounding_mode="floor")
            coord = (coord - starts[d]) * mult
            local = coord if local is None else local + coord
            mult *= widths[d]
        del flat, rest
        assert local is not None
        local = local.to(window_index_dtype(window))
        ctx.save_for_backward(local)
        ctx.geometry = (n, in_spatial, out_spatial, widths)  # plain numbers: no tensor kept
        ctx.x_shape = x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (local,) = ctx.saved_tensors
        n, in_spatial, out_spatial, widths = ctx.geometry
        starts = []
        for d in range(n):
            view = [1] * n
            view[d] = out_spatial[d]
            s = _adaptive_windows(in_spatial[d], out_spatial[d])[0]
            starts.append(torch.tensor(s, device=grad.device).view(view))
        rest = local.long()
        flat: Tensor | None = None
        step = 1
        for d in reversed(range(n)):
            coord = rest % widths[d] if d > 0 else rest
            if d > 0:
                rest = rest.div(widths[d], rounding_mode="floor")
            coord = (coord + starts[d]) * step
            flat = coord if flat is None else flat + coord
            step *= in_spatial[d]
        assert flat is not None
        shape = list(ctx.x_shape)
        if n == 1:  # 1d runs as 2d over a height of one, as ATen does
            grad, flat = grad.unsqueeze(-2), flat.unsqueeze(-2)
            shape = [*shape[:-1], 1, shape[-1]]
        stand_in = grad.new_empty(1).expand(shape)  # only its shape is read
        backward = (
            torch.ops.aten.adaptive_max_pool3d_backward if n == 3 else torch.ops.aten.adaptive_max_pool2d_backward
        )
        grad_x = backward(grad, stand_in, flat)
        return (grad_x.squeeze(-2) if n == 1 else grad_x), None, None


class _MemSaveAdaptiveMaxPoolMixin:
    _n: int

    def forward(self, input: Tensor) -> Tensor:
        mod: Any = self
        if mod.return_indices or not (torch.is_grad_enabled() and input.requires_grad):
            return super().forward(input)  # type: ignore[misc]
        _holder.compact(_holder.RECENT)
        return _AdaptiveMaxPool.apply(input, mod.output_size, self._n)


class MemSaveAdaptiveMaxPool1d(_MemSaveAdaptiveMaxPoolMixin, nn.AdaptiveMaxPool1d):
    """``nn.AdaptiveMaxPool1d`` keeping a window-local argmax (stock: input + int64 indices)."""

    _n = 1


class MemSaveAdaptiveMaxPool2d(_MemSaveAdaptiveMaxPoolMixin, nn.AdaptiveMaxPool2d):
    """``nn.AdaptiveMaxPool2d`` keeping a window-local argmax (stock: input + int64 indices)."""

    _n = 2


class MemSaveAdaptiveMaxPool3d(_MemSaveAdaptiveMaxPoolMixin, nn.AdaptiveMaxPool3d):
    """``nn.AdaptiveMaxPool3d`` keeping a window-local argmax (stock: input + int64 indices)."""

    _n = 3
