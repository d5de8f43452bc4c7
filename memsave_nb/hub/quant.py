"""QLoRA's frozen base: linear layers held as bitsandbytes holds them, measured by the engine.

bitsandbytes 0.50 builds and runs on the CPU, but its ``Params4bit`` carries its quantisation
state outside the tensor (``quant_state``), which the engine's fake-mode parameter swap cannot
follow, and it quantises real values only (nothing on the meta device). So this module holds a
stand-in with bitsandbytes' storage layout and the same dequantised temporaries:

- ``nf4``: ``Linear4bit(quant_type="nf4", compress_statistics=True, blocksize=64)``. Packed
  weights ``uint8 (n/2, 1)``; one absmax per block of 64, itself quantised to ``uint8`` (double
  quantisation) with a ``float32`` absmax per block of 256, a ``float32`` 256-entry code and a
  ``float32`` offset; the 16-entry NF4 code. Forward: the absmax dequantised to ``float32``
  (n/64), then the weight to the compute dtype (n), used, freed; nothing saved but the packed
  state; backward dequantises again for the input gradient (bitsandbytes' ``MatMul4Bit``).
- ``int8``: ``Linear8bitLt(has_fp16_weights=False)``. ``int8 (out, in)`` weights and a ``float32``
  scale per row (``SCB``). Its CPU path (``MatMul8bitFp``): the weight dequantised in forward,
  the input kept for backward, the weight dequantised again there.

Which layers: those transformers' bitsandbytes integration replaces (``replace_with_bnb_linear``):
every ``nn.Linear`` and every ``Conv1D`` (GPT-2's; its ``(in, out)`` weight transposed first, as
the integration does), except the modules its quantiser skips (tied weights, the last module, the
output embeddings, the model's ``_keep_in_fp32_modules``, e.g. T5's ``wo``): :func:`skipped_modules`.

Each dequantisation is one custom op, as bitsandbytes' kernels are, so the tracker sees its output
and no intermediate. The quantised tensors are buffers: the engine counts them as parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 64  # bitsandbytes' default 4-bit blocksize
ABSMAX_BLOCK = 256  # its blocksize for the second (double) quantisation
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)  # the NF4 levels (QLoRA paper, appendix E)
QUANT_TYPES = ("nf4", "int8")


# -- the kernels: one op each, like bitsandbytes' ------------------------------------------------
@torch.library.custom_op("memsave_nb::dequantize_absmax", mutates_args=())
def dequantize_absmax(
    absmax_q: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """Second-level dequantisation: uint8 absmax -> float32 absmax (one per 64-block)."""
    n = absmax_q.numel()
    scale = absmax2.repeat_interleave(ABSMAX_BLOCK)[:n]
    return code2[absmax_q.long()] * scale + offset


@dequantize_absmax.register_fake
def _(absmax_q, absmax2, code2, offset):
    return absmax_q.new_empty(absmax_q.shape, dtype=torch.float32)


@torch.library.custom_op("memsave_nb::dequantize_nf4", mutates_args=())
def dequantize_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, rows: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Packed 4-bit indices and float32 absmax -> the ``(rows, cols)`` weight in ``dtype``."""
    flat = packed.reshape(-1)
    idx = torch.stack((flat >> 4, flat & 15), dim=1).reshape(-1).long()
    values = code[idx] * absmax.repeat_interleave(BLOCK)[: idx.numel()]
    return values[: rows * cols].reshape(rows, cols).to(dtype)


@dequantize_nf4.register_fake
def _(packed, absmax, code, rows, cols, dtype):
    return packed.new_empty((rows, cols), dtype=dtype)


@torch.library.custom_op("memsave_nb::dequantize_int8", mutates_args=())
def dequantize_int8(weight: torch.Tensor, scb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows and their float32 scales -> the weight in ``dtype``."""
    return (weight.to(torch.float32) * (scb.unsqueeze(1) / 127.0)).to(dtype)


@dequantize_int8.register_fake
def _(weight, scb, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


# -- quantisation of real values (the real-mode path; meta weights get empty tensors) -------------
def _nearest(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The index (uint8) of the nearest of the sorted ``levels`` for each value, ties to the lower:
    a search among the midpoints, with no ``values x levels`` temporary (5 GB for GPT-2's weights)."""
    return torch.bucketize(values, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)


def _nf4_state(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, cols = weight.shape
    n = rows * cols
    blocks = -(-n // BLOCK)
    outer = -(-blocks // ABSMAX_BLOCK)
    device = weight.device
    code = torch.tensor(NF4, dtype=torch.float32, device=device)
    code2 = torch.linspace(-1.0, 1.0, 256, dtype=torch.float32, device=device)  # a signed 8-bit map
    if device.type == "meta":
        return {
            "packed": torch.empty(-(-n // 2), 1, dtype=torch.uint8, device=device),
            "absmax_q": torch.empty(blocks, dtype=torch.uint8, device=device),
            "absmax2": torch.empty(outer, dtype=torch.float32, device=device),
            "code2": code2,
            "offset": torch.empty((), dtype=torch.float32, device=device),
            "code": code,
        }
    flat = F.pad(weight.detach().float().reshape(-1), (0, blocks * BLOCK - n)).reshape(blocks, BLOCK)
    absmax = flat.abs().amax(dim=1).clamp_min(1e-12)
    idx = _nearest(flat / absmax[:, None], code).reshape(-1)
    idx = F.pad(idx, (0, idx.numel() % 2))
    packed = ((idx[0::2] << 4) | idx[1::2])[: -(-n // 2)].clone().reshape(-1, 1)  # (n+1)//2 bytes, as bitsandbytes
    offset = absmax.mean()
    centred = F.pad(absmax - offset, (0, outer * ABSMAX_BLOCK - blocks)).reshape(outer, ABSMAX_BLOCK)
    absmax2 = centred.abs().amax(dim=1).clamp_min(1e-12)
    absmax_q = _nearest(centred / absmax2[:, None], code2).reshape(-1)[:blocks].clone()  # own storage: no padding kept
    return {"packed": packed, "absmax_q": absmax_q, "absmax2": absmax2, "code2": code2, "offset": offset, "code": code}


def _int8_state(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    if weight.device.type == "meta":
        return {
            "weight": torch.empty(weight.shape, dtype=torch.int8, device="meta"),
            "SCB": torch.empty(weight.shape[0], dtype=torch.float32, device="meta"),
        }
    w = weight.detach().float()
    scb = w.abs().amax(dim=1).clamp_min(1e-12)
    return {"weight": torch.round(w * (127.0 / scb[:, None])).to(torch.int8), "SCB": scb}


# -- autograd: dequantise in forward, again in backward -------------------------------------------
class _NF4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, layer):
        ctx.layer = layer
        out = F.linear(x, layer.dequantized(x.dtype), bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.matmul(ctx.layer.dequantized(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None


class _Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)  # MatMul8bitFp keeps its input (ctx.A)
        return F.linear(x, layer.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad.matmul(ctx.layer.dequantized(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None


class QuantLinear(nn.Module):
    """A frozen linear layer stored as bitsandbytes stores it (``nf4`` or ``int8``)."""

    def __init__(self, linear: nn.Module, quant_type: str):
        super().__init__()
        if quant_type not in QUANT_TYPES:
            raise ValueError(quant_type)
        self.quant_type = quant_type
        weight: torch.Tensor = linear.weight  # type: ignore[assignment]
        if not isinstance(linear, nn.Linear):  # transformers' Conv1D: weight (in, out), y = x @ W + b
            weight = weight.t()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.compute_dtype = weight.dtype
        state = _nf4_state(weight) if quant_type == "nf4" else _int8_state(weight)
        for name, tensor in state.items():
            self.register_buffer(name, tensor)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)  # type: ignore[operator]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quant_type == "int8":
            return dequantize_int8(self.weight, self.SCB, dtype)
        absmax = dequantize_absmax(self.absmax_q, self.absmax2, self.code2, self.offset)
        return dequantize_nf4(self.packed, absmax, self.code, self.out_features, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _NF4Matmul if self.quant_type == "nf4" else _Int8Matmul
        return fn.apply(x, self.bias, self)

    def storage_bytes(self) -> int:
        """Bytes of the quantised weight and its state (what bitsandbytes keeps on the GPU)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, quant_type={self.quant_type!r}"


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def skipped_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules transformers' bitsandbytes quantiser leaves unquantised in ``model`` (a
    ``PreTrainedModel``, before peft wraps it): its default skips and ``_keep_in_fp32_modules``."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return tuple(m for name, m in model.named_modules() if name and not should_convert_module(name, patterns))


def quantize_linears(model: nn.Module, quant_type: str, keep: tuple[nn.Module, ...] = ()) -> list[str]:
    """Replace every frozen ``nn.Linear`` and ``Conv1D`` (its weight needs no gradient; not one of
    ``keep``) by a :class:`QuantLinear`; return the replaced names. Run it after LoRA has frozen the
    base: the adapters and ``modules_to_save`` train and stay as they are; pass :func:`skipped_modules`
    as ``keep`` to leave what transformers' integration leaves (the output head, T5's ``wo``)."""
    kept = {id(m) for m in keep}
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if (
                (type(child) is nn.Linear or _is_conv1d(child))
                and not child.weight.requires_grad
                and id(child) not in kept
            ):
                setattr(module, child_name, QuantLinear(child, quant_type))
                replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced
