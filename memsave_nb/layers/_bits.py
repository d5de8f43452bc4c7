"""Pack boolean masks into 1 bit per element: the physical floor for what a ReLU needs."""

from __future__ import annotations

import torch
from torch import Tensor

_BITS = 8


def packed_nbytes(numel: int) -> int:
    """Bytes a packed mask of ``numel`` elements occupies: ceil(numel / 8)."""
    return (numel + _BITS - 1) // _BITS


def pack_bits(mask: Tensor) -> Tensor:
    """Pack a bool tensor into a flat uint8 tensor of ``ceil(numel / 8)`` bytes.

    Bit ``i % 8`` of byte ``i // 8`` holds element ``i`` of ``mask`` in row-major
    (logical) order, whatever the memory format of ``mask``.
    """
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % _BITS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    cols = flat.view(-1, _BITS).view(torch.uint8)  # (numel / 8, 8), each 0 or 1
    packed = cols[:, 0].clone()
    for bit in range(1, _BITS):
        packed |= cols[:, bit] << bit
    return packed


def unpack_bits(packed: Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.bool
                ) -> Tensor:
    """Inverse of :func:`pack_bits`: a contiguous tensor of ``shape`` holding 0/1, as bool or
    (``dtype=torch.uint8``, which the stock backward kernels take directly) as uint8."""
    shifts = torch.arange(_BITS, device=packed.device, dtype=torch.uint8)
    bits = packed.unsqueeze(1) >> shifts  # (numel / 8, 8); one byte per element, then in place
    bits &= 1
    numel = 1
    for size in shape:
        numel *= size
    return bits.view(-1)[:numel].view(dtype).view(shape)
