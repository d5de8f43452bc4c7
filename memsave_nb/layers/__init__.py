"""Memory-saving drop-in layers and in-place conversion.

Each layer subclasses its stock ``torch.nn`` class and keeps for backward only what the
gradients asked for at forward time need (see ``docs/layers.md``). Layers know nothing of
measurement.
"""

from ._holder import compact
from .activation import MemSaveLeakyReLU, MemSaveReLU, masked_leaky_relu
from .batchnorm import MemSaveBatchNorm1d, MemSaveBatchNorm2d, MemSaveBatchNorm3d
from .conv import (
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
    convolution,
)
from .convert import MEMSAVE_LAYERS, Conversion, Swap, convert, revert
from .dropout import MemSaveDropout, masked_dropout
from .norm import MemSaveRMSNorm
from .pool import MemSaveMaxPool1d, MemSaveMaxPool2d, MemSaveMaxPool3d, max_pool

__all__ = [
    "MEMSAVE_LAYERS",
    "Conversion",
    "MemSaveBatchNorm1d",
    "MemSaveBatchNorm2d",
    "MemSaveBatchNorm3d",
    "MemSaveConv1d",
    "MemSaveConv2d",
    "MemSaveConv3d",
    "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d",
    "MemSaveConvTranspose3d",
    "MemSaveDropout",
    "MemSaveLeakyReLU",
    "MemSaveMaxPool1d",
    "MemSaveMaxPool2d",
    "MemSaveMaxPool3d",
    "MemSaveReLU",
    "MemSaveRMSNorm",
    "Swap",
    "compact",
    "convert",
    "convolution",
    "masked_dropout",
    "masked_leaky_relu",
    "max_pool",
    "revert",
]
