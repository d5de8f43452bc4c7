"""SDPA as CUDA runs it, on a fake CPU twin: the backend CUDA would pick, and that backend's op.

Why: on the CPU, ``F.scaled_dot_product_attention`` picks the CPU's kernel (flash for CPU, or
math), which saves other tensors than the kernel a GPU picks: CUDA's memory-efficient kernel pads
its log-sum-exp to 32 query rows and keeps the attention bias; CUDA's math fallback (head dims no
fused kernel takes) keeps the ``seq x seq`` probabilities. Under fake mode the CUDA kernels' own
ops (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``) run on fake CPU tensors
through their meta functions, with their autograd formulas: the twin saves what the GPU saves.

The choice follows ``select_sdp_backend`` in PyTorch's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (read at pytorch/pytorch 001f694a,
torch 2.13-era): the priority order (cuDNN first on sm90/sm100 when the wheel's cuDNN is newer than
9.15, ``check_prefer_cudnn_attention``; else flash, memory-efficient, math) and each backend's
filters (``can_use_cudnn_attention``, ``can_use_flash_attention``,
``can_use_mem_efficient_attention``). Assumed: the CUDA wheel's cuDNN is newer than 9.22
(nvidia-cudnn-cu12 9.27 was current in 2026-09), so cuDNN takes head dims up to 256 on sm90/sm10x.
The composite around the kernels (bool masks made additive, the memory-efficient bias padded,
flash's head dim padded to 8) follows ``scaled_dot_product_attention`` in ``attention.cpp``.
Dense inputs only; user switches (``torch.backends.cuda.enable_*_sdp``) are not read: the twin
sizes torch's defaults. Fake mode only (the CUDA ops have no CPU kernels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..workload import SIZED_GPUS, check_gpu

FLASH, EFFICIENT, CUDNN, MATH = "flash", "memory-efficient", "cudnn", "math"
TITLE = {
    FLASH: "flash attention",
    EFFICIENT: "memory-efficient attention",
    CUDNN: "cuDNN attention",
    MATH: "math attention",
}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU generation as ``sdp_utils.cpp`` reads it: the compute capability. ``cudnn_first``:
    cuDNN attention leads the priority order (sm90 / sm10x with a cuDNN newer than 9.15)."""

    name: str
    major: int
    minor: int

    @property
    def cudnn_first(self) -> bool:
        return (self.major == 9 and self.minor == 0) or (self.major == 10 and self.minor in (0, 3))


GPUS = {name: Gpu(name, *cc) for name, cc in SIZED_GPUS.items()}


def gpu_of(name: str | None) -> Gpu:
    """The GPU generation named (``"a100"``, ``"h100"``, ...; None: the default, an H100)."""
    return GPUS[check_gpu(name)]


def _sm(gpu: Gpu, low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= (gpu.major, gpu.minor) <= high


def select_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    gpu: Gpu,
) -> str:
    """The backend CUDA's ``select_sdp_backend`` returns for these inputs on ``gpu``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return MATH  # check_tensor_shapes: the fused kernels take 4-D inputs only
    if any(t.size(2) == 0 for t in (q, k, v)) or any(t.stride(-1) != 1 for t in (q, k, v)):
        return MATH  # check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense
    if q.size(1) != k.size(1) and not (enable_gqa and q.size(1) % k.size(1) == 0):
        return MATH  # check_batch_size_and_num_heads_dense
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    half = q.dtype in (torch.float16, torch.bfloat16)
    low_precision = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and gpu.major >= 8)
    d_qk, d_v = q.size(-1), v.size(-1)
    order = (CUDNN, FLASH, EFFICIENT, MATH) if gpu.cudnn_first else (FLASH, EFFICIENT, MATH)
    for backend in order:
        if backend == CUDNN:  # check_cudnn_tensor_shapes, check_cudnn_d256_bprop_head_dim (cuDNN > 9.22)
            limit = 256 if gpu.cudnn_first else 128
            bprop = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
            ok = (
                low_precision
                and _sm(gpu, (8, 0), (12, 1))
                and dropout_p * 16 == math.floor(dropout_p * 16)
                and d_qk <= limit
                and d_v <= limit
                and d_qk % 8 == 0
                and d_v % 8 == 0
                and k.size(2) != 1
                and (not grad or not gpu.cudnn_first or bprop)
            )
        elif backend == FLASH:
            sm86_89_120 = _sm(gpu, (8, 6), (8, 9)) or _sm(gpu, (12, 0), (12, 1))
            big_head = d_qk > 192 and (d_qk <= 224 or dropout_p > 0)
            ok = (
                attn_mask is None
                and d_qk == k.size(-1) == d_v
                and d_qk <= 256
                and _sm(gpu, (8, 0), (12, 1))
                and not (grad and sm86_89_120 and big_head)
                and not (is_causal and q.size(2) != k.size(2))
                and low_precision
            )
        elif backend == EFFICIENT:
            align = (8 if half else 4) if gpu.major >= 8 else (8 if half and gpu.major >= 7 else 1)
            dtypes = (
                (torch.float16, torch.float32, torch.bfloat16) if gpu.major >= 8 else (torch.float16, torch.float32)
            )
            ok = (
                _sm(gpu, (5, 0), (12, 1))
                and d_qk == k.size(-1)
                and d_qk % align == 0
                and d_v % align == 0
                and q.dtype in dtypes
            )
        else:
            ok = True
        if ok:
            return backend
    return MATH


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a bool mask becomes 0 / -inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device))


def _aligned(t: torch.Tensor, alignment: int = 8) -> bool:
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad the bias's last dim to a multiple of 8 unless aligned, expand."""
    if not _aligned(mask):
        n = mask.size(-1)
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def run_backend(backend: str, q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale, enable_gqa: bool):
    """The CUDA composite's call for ``backend`` (``attention.cpp``), returning the output."""
    if backend == MATH:
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, _additive(attn_mask, q.dtype), dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if backend == CUDNN:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, _additive(attn_mask, q.dtype), lse, dropout_p, is_causal, False, scale=scale
        )[0]  # its backward's workspace comes from cuDNN's plan on the GPU: not sized (attention_notes)
    if backend == EFFICIENT:
        mask = _additive(attn_mask, q.dtype)
        mask = _preprocess_mask(mask, q, k) if mask is not None else None
        if k.size(1) != q.size(1):  # GQA: its backward returns per-query-head grads; repeat as math does
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, lse, dropout_p, is_causal, scale=scale
        )[0]
        return _with_backward_buffers(out, backward_buffers(EFFICIENT, q, k, v))
    d = q.size(-1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if d % 8:  # pad_last_dim<8>: padded copies of q, k, v go into the kernel (and are saved)
        q, k, v = (F.pad(t, (0, 8 - d % 8)) for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    out = _with_backward_buffers(out, backward_buffers(FLASH, q, k, v))
    return out[..., :d] if d % 8 else out


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


Buffers = list[tuple[tuple[int, ...], torch.dtype]]


def backward_buffers(backend: str, q, k, v) -> Buffers:
    """The buffers the CUDA kernel's backward allocates beside dq, dk, dv and frees on return, as
    (shape, dtype); q, k, v as the kernel gets them (B, H, L, D).

    Flash (``flash_api.cpp`` ``mha_bwd``, dense, not deterministic): ``softmax_d`` fp32
    ``B x H x round128(Lq)``, ``dq_accum`` fp32 ``B x round128(Lq) x H x round(D, 32 if D <= 128
    else 64)``, and with fewer key/value heads ``dk_expanded`` / ``dv_expanded`` ``B x Lk x H x D`` in
    q's dtype. Memory-efficient (``attention_backward.cu`` ``_efficient_attention_backward``):
    ``delta`` fp32 ``B x H x Lq``; fp32 inputs compute it outside the kernel from
    ``(grad_out.float() * out.float()).sum(-1)``, whose fp32 product ``B x Lq x H x Dv`` and sum
    ``B x Lq x H`` live until the expression ends (``kKernelComputesDelta`` is false for fp32). The
    cutlass kernel's workspace is 0 for fp32 (no gradQ/gradK accumulation); fp16/bf16 kernels
    accumulate dQ in an fp32 workspace whose size depends on the kernel picked (``cutlassB.h``): not
    sized (``attention_notes``)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (q, k, v)):
        return []
    b, h, lq, d = q.shape
    lk = k.size(2)
    f32 = torch.float32
    if backend == FLASH:
        out: Buffers = [
            ((b, h, _round(lq, 128)), f32),
            ((b, _round(lq, 128), h, _round(d, 32 if d <= 128 else 64)), f32),
        ]
        if k.size(1) != h:
            out += [((b, lk, h, d), q.dtype)] * 2
        return out
    if backend == EFFICIENT:
        delta: Buffers = [((b, h, lq), f32)]
        if q.dtype == torch.float32:
            delta += [((b, lq, h, v.size(-1)), f32), ((b, lq, h), f32)]
        return delta
    return []


def buffer_bytes(buffers: Buffers) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in buffers)


def _with_backward_buffers(out: torch.Tensor, buffers: Buffers) -> torch.Tensor:
    """Hooks on the kernel's backward node: the buffers are allocated just before it runs (the real
    kernel allocates them after dq, dk, dv: the same peak) and freed when it has run."""
    node = out.grad_fn
    if not buffers or node is None:
        return out
    live: list[torch.Tensor] = []

    def before(grad_outputs):
        ref = next(g for g in grad_outputs if g is not None)
        live.extend(ref.new_empty(shape, dtype=dtype) for shape, dtype in buffers)

    def after(grad_inputs, grad_outputs):
        live.clear()

    node.register_prehook(before)
    node.register_hook(after)
    return out


class CudaAttention:
    """Answers ``F.scaled_dot_product_attention`` with CUDA's backend; records each choice."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.backends: dict[str, int] = {}
        self.unsized: set[str] = set()  # backends whose backward ran with a workspace not sized

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        dropout_p, is_causal, enable_gqa = float(dropout_p), bool(is_causal), bool(enable_gqa)
        if torch.is_autocast_enabled("cpu"):  # the twin's autocast stands for CUDA's, whose lower-precision
            low = torch.get_autocast_dtype("cpu")  # list holds scaled_dot_product_attention (cached_cast:
            query, key, value, attn_mask = (  # every floating argument but float64 goes to the low dtype)
                t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
                for t in (query, key, value, attn_mask)
            )
        with torch.autocast("cpu", enabled=False):
            backend = select_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self.gpu)
            self.backends[backend] = self.backends.get(backend, 0) + 1
            training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if training and (backend == CUDNN or (backend == EFFICIENT and query.dtype != torch.float32)):
                self.unsized.add(backend)
            return run_backend(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# Why a patched function and not a TorchFunctionMode: a mode is switched off while its handler runs,
# so ``loss.backward()`` passed through it runs a checkpoint's recomputation without it (the
# recomputed SDPA then saves other tensors and torch.utils.checkpoint refuses). The patch answers
# only on the thread that opened ``cuda_attention`` (the CPU autograd engine recomputes there).
_ORIGINAL = F.scaled_dot_product_attention
_LOCAL = threading.local()
_USERS = [0]
_GUARD = threading.Lock()


def _patched(*args, **kwargs):
    active = getattr(_LOCAL, "stack", None)
    if active:
        return active[-1](*args, **kwargs)
    return _ORIGINAL(*args, **kwargs)


@contextlib.contextmanager
def cuda_attention(gpu: str | Gpu | None = None) -> Iterator[CudaAttention]:
    """While open, SDPA calls on this thread run the kernel CUDA would pick on ``gpu`` (fake
    tensors only: the CUDA kernels' ops have no CPU kernels)."""
    answer = CudaAttention(gpu if isinstance(gpu, Gpu) else gpu_of(gpu))
    with _GUARD:
        _USERS[0] += 1
        F.scaled_dot_product_attention = _patched
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(answer)
    try:
        yield answer
    finally:
        stack.pop()
        with _GUARD:
            _USERS[0] -= 1
            if not _USERS[0]:
                F.scaled_dot_product_attention = _ORIGINAL


def attention_notes(attention: CudaAttention | None) -> tuple[str, ...]:
    """The measurement's notes on the attention backward's buffers the twin could not size."""
    if attention is None or not attention.unsized:
        return ()
    why = {
        CUDNN: "cuDNN attention's backward workspace (its size comes from cuDNN's execution plan, chosen on the GPU)",
        EFFICIENT: "the fp16/bf16 memory-efficient kernel's fp32 dQ accumulation workspace (up to about an fp32 dQ; "
        "its size depends on the cutlass kernel picked)",
    }
    return tuple(f"not counted: {why[b]}" for b in sorted(attention.unsized))


def title_words(backends: dict[str, int]) -> str:
    """The attention backends a step ran, for a title: ``"flash attention"``, or several joined."""
    return " and ".join(TITLE[b] for b in sorted(backends, key=lambda b: -backends[b]))


@contextlib.contextmanager
def sized_attention(workload: Any) -> Iterator[CudaAttention | None]:
    """``cuda_attention`` for a fake-mode step of a workload sized for CUDA; else nothing (None)."""
    if getattr(workload, "sized_for", None) != "cuda":
        yield None
        return
    with cuda_attention(getattr(workload, "gpu", None)) as mode:
        yield mode
