"""Memory-saving drop-in layers and in-place conversion.

Each layer subclasses its stock ``torch.nn`` class and keeps for backward only what the
gradients asked for at forward time need (see ``docs/layers.md``). Layers know nothing of
measurement.
"""

from ._holder import compact
from .activation import (
    MemSaveHardtanh,
    MemSaveLeakyReLU,
    MemSaveReLU,
    MemSaveReLU6,
    masked_hardtanh,
    masked_leaky_relu,
)
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
from .dropout import (
    MemSaveAlphaDropout,
    MemSaveDropout,
    MemSaveDropout1d,
    MemSaveDropout2d,
    MemSaveDropout3d,
    MemSaveFeatureAlphaDropout,
    masked_dropout,
)
from .norm import MemSaveRMSNorm
from .pool import (
    MemSaveAdaptiveMaxPool1d,
    MemSaveAdaptiveMaxPool2d,
    MemSaveAdaptiveMaxPool3d,
    MemSaveMaxPool1d,
    MemSaveMaxPool2d,
    MemSaveMaxPool3d,
    max_pool,
)

__all__ = [
    "Conversion",
    "MEMSAVE_LAYERS",
    "MemSaveAdaptiveMaxPool1d",
    "MemSaveAdaptiveMaxPool2d",
    "MemSaveAdaptiveMaxPool3d",
    "MemSaveAlphaDropout",
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
    "MemSaveDropout1d",
    "MemSaveDropout2d",
    "MemSaveDropout3d",
    "MemSaveFeatureAlphaDropout",
    "MemSaveHardtanh",
    "MemSaveLeakyReLU",
    "MemSaveMaxPool1d",
    "MemSaveMaxPool2d",
    "MemSaveMaxPool3d",
    "MemSaveRMSNorm",
    "MemSaveReLU",
    "MemSaveReLU6",
    "Swap",
    "compact",
    "convert",
    "convolution",
    "masked_dropout",
    "masked_hardtanh",
    "masked_leaky_relu",
    "max_pool",
    "revert",
]
