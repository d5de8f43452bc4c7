"""The attention backward's transient buffers on CUDA (issue 40 part 2), allocated by the twin's
fake backward as the kernels allocate them, and the ones it cannot size said in the notes.

The expected bytes are written out from torch's source: flash_attn ``flash_api.cpp`` ``mha_bwd``
(``softmax_d``, ``dq_accum``, GQA's ``dk_expanded``/``dv_expanded``) and ``attention_backward.cu``
``_efficient_attention_backward`` (``delta``; for fp32 its product and sum)."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_nb import Workload, measure
from memsave_nb.measure import cuda_attention as cuda_attention_module
from memsave_nb.measure.cuda_attention import backward_buffers, buffer_bytes, cuda_attention
from tests.measure import hf_models


class Allocations(TorchDispatchMode):
    """Every tensor an op makes while open: its bytes, and a weak reference (to see it freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.new_empty.default,):
            self.made.append((str(func), out.untyped_storage().nbytes(), weakref.ref(out)))
        return out


def _backward(gpu: str, dtype: torch.dtype, b: int, h: int, hk: int, length: int, d: int, mask: bool = False):
    with FakeTensorMode():
        q = torch.randn(b, h, length, d, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(b, hk, length, d, dtype=dtype, requires_grad=True) for _ in range(2))
        bias = torch.zeros(b, 1, length, length, dtype=dtype) if mask else None
        with cuda_attention(gpu) as attention:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=hk != h)
            log = Allocations()
            with log:
                out.sum().backward()
    return attention, log


@pytest.mark.parametrize(
    "case, expected",
    [
        # flash, bf16, A100: softmax_d 2x4x128 fp32 + dq_accum 2x128x4x64 fp32
        (("a100", torch.bfloat16, 2, 4, 4, 100, 64), 2 * 4 * 128 * 4 + 2 * 128 * 4 * 64 * 4),
        # the same with 2 key/value heads: + dk_expanded and dv_expanded, 2x100x4x64 bf16 each
        (("a100", torch.bfloat16, 2, 4, 2, 100, 64), 266_240 + 2 * (2 * 100 * 4 * 64 * 2)),
        # flash, fp16, head dim 96, 300 tokens: softmax_d 1x8x384 + dq_accum 1x384x8x96 (96 rounds to 96)
        (("a100", torch.float16, 1, 8, 8, 300, 96), 1 * 8 * 384 * 4 + 1 * 384 * 8 * 96 * 4),
    ],
)
def test_flash_backward_buffers(case, expected):
    attention, log = _backward(*case)
    assert attention.backends == {"flash": 1} and not attention.unsized
    assert sum(n for _, n, _ in log.made) == expected
    assert all(ref() is None for _, _, ref in log.made)  # freed once the kernel's backward has run


def test_memory_efficient_fp32_backward_buffers():
    """fp32 with a mask on an A100: delta 2x4x100 fp32, and the fp32 product 2x100x4x64 and its sum
    2x100x4 that compute it (the fp32 kernel has no workspace)."""
    attention, log = _backward("a100", torch.float32, 2, 4, 4, 100, 64, mask=True)
    assert attention.backends == {"memory-efficient": 1} and not attention.unsized
    assert sorted(n for _, n, _ in log.made) == [3_200, 3_200, 204_800]
    q = torch.empty(2, 4, 100, 64, requires_grad=True)
    assert buffer_bytes(backward_buffers("memory-efficient", q, q, q)) == 211_200
    assert backward_buffers("memory-efficient", q.detach(), q.detach(), q.detach()) == []  # no backward


def test_what_is_not_sized_is_said():
    attention, log = _backward("h100", torch.bfloat16, 2, 4, 4, 100, 64)
    assert attention.backends == {"cudnn": 1} and attention.unsized == {"cudnn"} and not log.made
    attention, _ = _backward("a100", torch.bfloat16, 2, 4, 4, 100, 64, mask=True)
    assert attention.backends == {"memory-efficient": 1} and attention.unsized == {"memory-efficient"}
    m = measure(hf_models.llama().replace(autocast_dtype=torch.bfloat16, sized_for="cuda"), "fake", repeats=0)
    assert any(n.startswith("not counted: cuDNN attention's backward workspace") for n in m.notes)
    a100 = measure(
        hf_models.llama().replace(sized_for="cuda", gpu="a100", autocast_dtype=torch.bfloat16), "fake", repeats=0
    )
    assert not any(n.startswith("not counted") for n in a100.notes)


class _Attention(nn.Module):
    """A projection to q, k, v (4 heads of 16) and SDPA with a float mask: the step's peak is in the
    attention's backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(b, 1, length, length)).sum()


def test_the_measured_peak_carries_the_buffers(monkeypatch):
    """The same step without the buffers (our own function switched off) peaks lower by exactly them:
    memory-efficient fp32 on an A100, B=2, H=4, L=100, D=16: delta 3,200 + product 51,200 + sum 3,200."""
    w = Workload(
        _Attention(), torch.randn(2, 100, 64), loss=lambda y: y, optimizer="none", sized_for="cuda", gpu="a100"
    )
    with_buffers = measure(w, "fake", repeats=0)
    monkeypatch.setattr(cuda_attention_module, "backward_buffers", lambda *args: [])
    without = measure(w, "fake", repeats=0)
    assert with_buffers.peak_bytes - without.peak_bytes == 2 * 4 * 100 * 4 + 2 * 100 * 4 * 16 * 4 + 2 * 100 * 4 * 4
    assert with_buffers.peak_bytes - without.peak_bytes == 57_600
