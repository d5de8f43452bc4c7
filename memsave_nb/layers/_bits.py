"""Pack boolean masks into 1 bit per element: the physical floor for what a ReLU needs.

Bit ``i % 8`` of byte ``i // 8`` holds element ``i`` (row-major, logical order).

Two implementations give the same bytes:

- On plain CPU tensors, numpy's SIMD ``packbits`` / ``unpackbits`` over the tensor's own
  memory (no copy for contiguous input): about a third of the time of the torch ops below
  (bench: ``python bench/bench_layers.py --bits``).
- Everywhere else (CUDA, fake tensors, meta, any dispatch mode such as a memory tracker or
  selective checkpointing, ``torch.compile``, functorch transforms) torch ops that such modes
  see: packing gathers eight 0/1 bytes into one byte with one 64-bit multiplication (each
  byte's bit lands in its own place of the top byte); unpacking spreads a byte back out by a
  256-entry table. The tensors made are the same size either way, so what a tracker counts
  is what an untracked step holds.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
    np = None  # type: ignore[assignment]

_BITS = 8
# w * _GATHER puts byte i's low bit at bit 56 + i (little-endian words); the other partial
# products land below bit 56 or above bit 63 without colliding, so no carry reaches the top byte.
_GATHER = 0x0102040810204080
_LITTLE_ENDIAN = sys.byteorder == "little"
_SPREAD: dict[torch.device, Tensor] = {}
_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def packed_nbytes(numel: int) -> int:
    """Bytes a packed mask of ``numel`` elements occupies: ceil(numel / 8)."""
    return (numel + _BITS - 1) // _BITS


def numpy_ok(t: Tensor) -> bool:
    """True when ``t``'s bits may be handled by numpy: a plain CPU tensor, outside any
    dispatch mode and compiler (where every op must be a torch op that the mode sees)."""
    return (
        np is not None
        and type(t) is Tensor
        and t.is_cpu
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and not (_is_wrapped is not None and _is_wrapped(t))
    )


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def positive(x: Tensor) -> Tensor:
    """``x > 0`` as a bool tensor (numpy's comparison where it may run: several times faster
    than torch's scalar comparison on this kind of CPU)."""
    if x.dtype in _NUMPY_FLOATS and numpy_ok(x):
        return torch.from_numpy(np.greater(x.detach().numpy(), 0))
    return x > 0


def pack_inside(x: Tensor, low: float, high: float) -> Tensor | None:
    """Packed bits of ``low < x < high`` (NaN: outside, as the vectorised body of stock's
    hardtanh backward treats it), or None where numpy may not run (then the caller builds the
    bool mask with torch ops and :func:`pack_bits`). Float32/64 only: there numpy compares in
    the tensor's dtype exactly as the stock kernel does."""
    if x.dtype not in (torch.float32, torch.float64) or not numpy_ok(x):
        return None
    a = x.detach().numpy().reshape(-1)
    cast = a.dtype.type
    inside = np.greater(a, cast(low))
    inside &= np.less(a, cast(high))
    return torch.from_numpy(np.packbits(inside, bitorder="little"))


def pack_bits(mask: Tensor) -> Tensor:
    """Pack a bool tensor into a flat uint8 tensor of ``ceil(numel / 8)`` bytes.

    Bit ``i % 8`` of byte ``i // 8`` holds element ``i`` of ``mask`` in row-major
    (logical) order, whatever the memory format of ``mask``.
    """
    if numpy_ok(mask):
        # numpy walks a strided view in logical order (a copy only for non-contiguous masks)
        packed_np = np.packbits(mask.detach().numpy().reshape(-1), bitorder="little")
        return torch.from_numpy(packed_np)
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


def unpack_bits(packed: Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.bool) -> Tensor:
    """Inverse of :func:`pack_bits`: a contiguous tensor of ``shape`` holding 0/1, as bool or
    (``dtype=torch.uint8``, which the stock backward kernels take directly) as uint8."""
    numel = 1
    for size in shape:
        numel *= size
    if numpy_ok(packed):
        bits_np = np.unpackbits(packed.detach().numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits_np).view(dtype).view(shape)
    if _LITTLE_ENDIAN:
        words = _spread_table(packed.device).index_select(0, packed.int())
        return words.view(torch.uint8)[:numel].view(dtype).view(shape)
    shifts = torch.arange(_BITS, device=packed.device, dtype=torch.uint8)
    bits = packed.unsqueeze(1) >> shifts  # (numel / 8, 8)
    bits &= 1
    return bits.view(-1)[:numel].view(dtype).view(shape)
