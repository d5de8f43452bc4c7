"""Pack boolean masks into 1 bit per element: the physical floor for what a ReLU needs.

Both directions work on whole 64-bit words so that packing costs about as much as one
elementwise op: eight 0/1 bytes gather into one byte by a multiplication (each byte's bit
lands in its own place of the top byte), and a 256-entry table spreads a byte back out.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

_BITS = 8
# w * _GATHER puts byte i's low bit at bit 56 + i (little-endian words); the other partial
# products land below bit 56 or above bit 63 without colliding, so no carry reaches the top byte.
_GATHER = 0x0102040810204080
_LITTLE_ENDIAN = sys.byteorder == "little"
_SPREAD: dict[torch.device, Tensor] = {}


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
    if _LITTLE_ENDIAN:
        if not torch.compiler.is_compiling() and flat.storage_offset() % _BITS:
            flat = flat.clone()
        words = flat.view(torch.int64)  # 8 elements (0/1 bytes) per word
        return (words * _GATHER).view(torch.uint8)[7::8].clone()  # each word's top byte
    cols = flat.view(-1, _BITS).view(torch.uint8)  # portable path: one shift per bit
    packed = cols[:, 0].clone()
    for bit in range(1, _BITS):
        packed |= cols[:, bit] << bit
    return packed


def _spread_table(device: torch.device) -> Tensor:
    """(256,) int64: the 8 bytes of word ``b`` are the bits of ``b``, lowest first."""
    # Under a dispatch mode (FakeTensorMode, a tracker) or a compiler, build it afresh: a
    # cached real tensor is foreign there, and a tensor made there must not leak out.
    plain = not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
    table = _SPREAD.get(device) if plain else None
    if table is None:
        bits = torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)
        table = (bits & 1).to(torch.uint8).view(torch.int64).view(-1)
        if plain and type(table) is Tensor:
            _SPREAD[device] = table
    return table


def unpack_bits(packed: Tensor, shape: torch.Size | tuple[int, ...],
                dtype: torch.dtype = torch.bool) -> Tensor:
    """Inverse of :func:`pack_bits`: a contiguous tensor of ``shape`` holding 0/1, as bool or
    (``dtype=torch.uint8``, which the stock backward kernels take directly) as uint8."""
    numel = 1
    for size in shape:
        numel *= size
    if _LITTLE_ENDIAN:
        words = _spread_table(packed.device).index_select(0, packed.int())
        return words.view(torch.uint8)[:numel].view(dtype).view(shape)
    shifts = torch.arange(_BITS, device=packed.device, dtype=torch.uint8)
    bits = packed.unsqueeze(1) >> shifts  # (numel / 8, 8)
    bits &= 1
    return bits.view(-1)[:numel].view(dtype).view(shape)
