"""Autocast's CUDA op lists against the CPU's, and what the difference costs (issue 40 part 2).

torch 2.13's ``aten/src/ATen/autocast_mode.{h,cpp}``: on CUDA, ``layer_norm`` /
``native_layer_norm`` / ``group_norm`` are on the fp32 list (``AT_FORALL_FP32``) and ``softmax`` /
``log_softmax`` / ``sum`` / ``cumsum`` on ``AT_FORALL_FP32_SET_OPT_DTYPE``; the CPU's lists
(``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``) hold none of them, so on the CPU they run in
their input's dtype. Where the input is bf16 (the output of a linear under autocast), CUDA saves
those ops' fp32 tensors (layer_norm its fp32 input, softmax its fp32 output): 2 more bytes per
element than the CPU's autocast (a step sized for CUDA now follows CUDA's lists: measure/cuda_autocast.py).

The oracle is the real CPU kernels' saved tensors (``saved_tensors_hooks``), with CUDA's policy
written out by hand (the casts CUDA's autocast inserts) beside the CPU's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, T, D, O = 2, 16, 32, 24


class Block(nn.Module):
    """linear -> layer_norm -> linear -> softmax, as CUDA's autocast runs it (``cuda=True``:
    layer_norm and softmax get fp32 inputs) or as the CPU's does (in the input's dtype)."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cuda_policy, self.fc1, self.ln, self.fc2 = cuda, nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, O)

    def forward(self, x):
        h = self.fc1(x)
        h = self.ln(h.float() if self.cuda_policy else h)
        y = self.fc2(h)
        return F.softmax(y, dim=-1, dtype=torch.float32) if self.cuda_policy else F.softmax(y, dim=-1)


def _saved(model: nn.Module) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        storages.setdefault(id(t.untyped_storage()), t.untyped_storage().nbytes())
        return t

    params = {id(p.untyped_storage()) for p in model.parameters()}
    x = torch.randn(B, T, D)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == (torch.float32 if model.cuda_policy else torch.bfloat16)
    return sum(n for k, n in storages.items() if k not in params and k != id(x.untyped_storage()))


def test_cuda_lists_save_two_more_bytes_per_element_of_layer_norm_and_softmax():
    cpu, cuda = _saved(Block(cuda=False)), _saved(Block(cuda=True))
    assert cuda - cpu == 2 * B * T * D + 2 * B * T * O == 3_584


def test_the_lists_differ_as_the_docs_say():
    """The CPU's autocast leaves layer_norm and softmax in bf16 here (so the twin does too)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.Linear(D, D)(torch.randn(2, D))
        assert h.dtype == torch.bfloat16
        assert F.layer_norm(h, (D,)).dtype == torch.bfloat16
        assert F.softmax(h, dim=-1).dtype == torch.bfloat16
