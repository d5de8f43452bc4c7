"""Swap memory-saving layers into a model in place, and back.

Each memory-saving class subclasses its stock class and adds no state, so converting is a
``__class__`` swap: the module object, its parameters, buffers, hooks and train/eval mode stay
the very same objects (no copy, no doubled memory, ``isinstance`` checks keep working), and
reverting restores the original class exactly.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _holder
from .activation import MemSaveHardtanh, MemSaveLeakyReLU, MemSaveReLU, MemSaveReLU6
from .batchnorm import MemSaveBatchNorm1d, MemSaveBatchNorm2d, MemSaveBatchNorm3d
from .conv import (
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
)
from .dropout import (
    MemSaveAlphaDropout,
    MemSaveDropout,
    MemSaveDropout1d,
    MemSaveDropout2d,
    MemSaveDropout3d,
    MemSaveFeatureAlphaDropout,
)
from .norm import MemSaveRMSNorm
from .pool import (
    MemSaveAdaptiveMaxPool1d,
    MemSaveAdaptiveMaxPool2d,
    MemSaveAdaptiveMaxPool3d,
    MemSaveMaxPool1d,
    MemSaveMaxPool2d,
    MemSaveMaxPool3d,
)

#: stock class -> memory-saving subclass. Exact types only: a user's subclass of a stock
#: layer may override forward, so it is left alone.
MEMSAVE_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: MemSaveConv1d,
    nn.Conv2d: MemSaveConv2d,
    nn.Conv3d: MemSaveConv3d,
    nn.ConvTranspose1d: MemSaveConvTranspose1d,
    nn.ConvTranspose2d: MemSaveConvTranspose2d,
    nn.ConvTranspose3d: MemSaveConvTranspose3d,
    nn.BatchNorm1d: MemSaveBatchNorm1d,
    nn.BatchNorm2d: MemSaveBatchNorm2d,
    nn.BatchNorm3d: MemSaveBatchNorm3d,
    nn.ReLU: MemSaveReLU,
    nn.LeakyReLU: MemSaveLeakyReLU,
    nn.ReLU6: MemSaveReLU6,
    nn.Hardtanh: MemSaveHardtanh,
    nn.Dropout: MemSaveDropout,
    nn.Dropout1d: MemSaveDropout1d,
    nn.Dropout2d: MemSaveDropout2d,
    nn.Dropout3d: MemSaveDropout3d,
    nn.AlphaDropout: MemSaveAlphaDropout,
    nn.FeatureAlphaDropout: MemSaveFeatureAlphaDropout,
    nn.RMSNorm: MemSaveRMSNorm,
    nn.MaxPool1d: MemSaveMaxPool1d,
    nn.MaxPool2d: MemSaveMaxPool2d,
    nn.MaxPool3d: MemSaveMaxPool3d,
    nn.AdaptiveMaxPool1d: MemSaveAdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d: MemSaveAdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d: MemSaveAdaptiveMaxPool3d,
}


@dataclass(frozen=True)
class Swap:
    """One module whose class was swapped."""

    name: str
    module: nn.Module
    original: type[nn.Module]
    replacement: type[nn.Module]


@dataclass
class Conversion:
    """What :func:`convert` swapped; pass it to :func:`revert` (or call ``.revert()``)."""

    model: nn.Module
    swaps: tuple[Swap, ...]
    _handle: RemovableHandle | None = field(default=None, repr=False)
    reverted: bool = False

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.swaps]

    def __len__(self) -> int:
        return len(self.swaps)

    def revert(self) -> None:
        revert(self)

    def __enter__(self) -> "Conversion":
        return self

    def __exit__(self, *exc: object) -> None:
        revert(self)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def convert(
    model: nn.Module,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
) -> Conversion:
    """Swap every stock layer of a registered type in ``model`` for its memory-saving subclass,
    in place. ``include``/``exclude`` are module names from ``named_modules()`` or fnmatch
    patterns over them (``None`` includes all, excludes none)."""
    inc = [include] if isinstance(include, str) else (None if include is None else list(include))
    exc = [exclude] if isinstance(exclude, str) else list(exclude or [])
    swaps = []
    for name, module in model.named_modules():
        replacement = MEMSAVE_LAYERS.get(type(module))
        if replacement is None:
            continue
        if inc is not None and not _matches(name, inc):
            continue
        if _matches(name, exc):
            continue
        swaps.append(Swap(name, module, type(module), replacement))
        module.__class__ = replacement
    handle = None
    if swaps:
        # ReLU outputs still held at the end of forward shrink to masks here
        handle = model.register_forward_hook(_compact_hook)
    return Conversion(model, tuple(swaps), handle)


def _compact_hook(module: nn.Module, args: object, output: object) -> None:
    _holder.compact(final=True)


def revert(conversion: Conversion) -> None:
    """Restore the original classes of every module :func:`convert` swapped (idempotent)."""
    if conversion.reverted:
        return
    for swap in reversed(conversion.swaps):
        if type(swap.module) is swap.replacement:
            swap.module.__class__ = swap.original
    if conversion._handle is not None:
        conversion._handle.remove()
    conversion.reverted = True
