"""The twin's autocast follows CUDA's op lists when a step is sized for CUDA (issue 40 part 2).

Oracles: the installed torch's own ``AutocastCUDA`` / ``AutocastCPU`` registrations (which ops each
device's autocast wraps), the real CPU kernels run with CUDA's casts written out by hand, and the
analytic bytes of the tensors CUDA's fp32 ops save."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb import Workload, measure
from memsave_nb.errors import WorkloadError
from memsave_nb.measure import cuda_autocast as ca
from tests.measure import hf_models

B, T, D, O = 2, 16, 32, 24


def _registered(key: str) -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {
        n.removeprefix("aten::").removesuffix(".default")
        for n in names
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    }


def test_the_cuda_lists_are_the_ops_the_installed_torch_wraps_on_cuda():
    listed = set(ca.CUDA_LOWER + ca.CUDA_FP32 + ca.CUDA_SET_DTYPE + ca.CUDA_PROMOTE + tuple(ca.CUDA_APPEND_DTYPE))
    assert listed | {"binary_cross_entropy"} == _registered("AutocastCUDA")
    assert set(ca.CPU_LOWER) | set(ca.CPU_PROMOTE) <= _registered("AutocastCPU")
    assert {"layer_norm", "softmax.int", "sum", "pow.Tensor_Scalar", "einsum", "cat"} <= set(ca.differing_ops())
    assert "linear" not in ca.differing_ops() and "mm" not in ca.differing_ops()  # same on both


class Block(nn.Module):
    """linear -> layer_norm -> linear -> softmax; ``by_hand``: CUDA's casts written out."""

    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.by_hand, self.fc1, self.ln, self.fc2 = by_hand, nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, O)

    def forward(self, x):
        h = self.fc1(x)
        h = self.ln(h.float() if self.by_hand else h)
        y = self.fc2(h)
        return F.softmax(y, dim=-1, dtype=torch.float32) if self.by_hand else F.softmax(y, dim=-1)


def _block(by_hand: bool = False, **kw) -> Workload:
    x = torch.randn(B, T, D)
    return Workload(
        Block(by_hand), x, loss=lambda y: y.float().sum(), optimizer="none", autocast_dtype=torch.bfloat16, **kw
    )


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_block_saves_what_cuda_autocast_saves(mode):
    cpu = measure(_block(), mode, repeats=0)
    with ca.cuda_autocast() as answer:
        cuda = measure(_block(), mode, repeats=0)
    by_hand = measure(_block(by_hand=True), mode, repeats=0)
    assert answer.ops == {"layer_norm": 1, "softmax.int": 1}
    assert cuda.saved_bytes == by_hand.saved_bytes
    # fp32 layer_norm input and softmax output: 2 B more per element (3,584 B). In fake mode the CPU
    # baseline keeps layer_norm's mean and rstd in bf16 (its meta function; the real CPU kernel, given an
    # fp32 weight, keeps them in fp32): 128 B more there. The CUDA-list runs agree in both modes.
    extra = 2 * B * T * D + 2 * B * T * O + (2 * 2 * B * T if mode == "fake" else 0)
    assert cuda.saved_bytes - cpu.saved_bytes == extra == {"real": 3_584, "fake": 3_712}[mode]
    assert cuda.saved_bytes == 13_056


def test_sized_for_cuda_follows_the_lists_and_says_so():
    plain = measure(_block(), "fake", repeats=0)
    sized = measure(_block(sized_for="cuda"), "fake", repeats=0)
    assert sized.saved_bytes - plain.saved_bytes == 3_712
    assert any(n.startswith("autocast as CUDA runs it: layer_norm, softmax.int") for n in sized.notes)
    assert not any("autocast as CUDA" in n for n in plain.notes)
    fp32 = measure(_block(sized_for="cuda").replace(autocast_dtype=None), "fake", repeats=0)
    assert not any("autocast as CUDA" in n for n in fp32.notes)


def test_llama_upcasts_by_hand_so_the_lists_change_nothing_it_saves():
    """HF Llama runs RMSNorm in fp32, softmax with dtype=float32 and the loss on logits.float(): CUDA's
    lists answer its pow/rsqrt/log_softmax but save the same bytes as the CPU's."""
    w = hf_models.llama().replace(autocast_dtype=torch.bfloat16)
    cpu = measure(w, "fake", repeats=0)
    with ca.cuda_autocast() as answer:
        cuda = measure(w, "fake", repeats=0)
    assert {"pow.Tensor_Scalar", "rsqrt", "log_softmax.int"} <= set(answer.ops)
    assert cuda.saved_bytes == cpu.saved_bytes


def test_gpt2_gelu_runs_in_fp32_on_cuda():
    """gelu_new's ``pow(x, 3.0)`` is on CUDA's fp32 list: the tanh after it (which saves its output)
    runs in fp32, 4 B per element of the MLP's hidden width, against the CPU's bf16."""
    w = hf_models.gpt2(layers=2, d=64).replace(autocast_dtype=torch.bfloat16)
    cpu = measure(w, "fake", repeats=0)
    with ca.cuda_autocast():
        cuda = measure(w, "fake", repeats=0)
    tanh = {m: next(o.saved_bytes for o in r.ops if o.op == "aten.tanh") for m, r in (("cpu", cpu), ("cuda", cuda))}
    elements = 2 * 2 * 32 * 4 * 64  # layers x batch x seq x 4d
    assert tanh == {"cpu": 2 * elements, "cuda": 4 * elements}


def test_other_threads_keep_the_cpu_lists_and_the_cpu_kernels_come_back():
    seen: dict[str, torch.dtype] = {}
    h = torch.randn(2, D, dtype=torch.bfloat16)

    def other() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["ln"] = F.layer_norm(h, (D,)).dtype
            seen["cat"] = torch.cat([h, h.float()]).dtype  # the CPU's promote

    with ca.cuda_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(h, (D,)).dtype == torch.float32
        assert torch.cat([h, h]).dtype == torch.bfloat16
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen == {"ln": torch.bfloat16, "cat": torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(h, (D,)).dtype == torch.bfloat16
    assert ca._USERS == [0] and not ca._LIBRARY


def test_each_policy_on_ops_the_two_devices_treat_differently():
    """One op per CUDA policy where the CPU's differs: fp32 (exp), fp32 output unless a dtype is given
    (sum, softmax), fp32 appended (norm), low precision over a tensor list (einsum), promote (addcmul),
    not listed on CUDA (cat, which the CPU promotes), float64 left alone, and the refused one."""
    h, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, 8)
    with ca.cuda_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert h.exp().dtype == h.sum().dtype == h.sum(1).dtype == torch.float32
        assert F.softmax(h, -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.ops.aten.norm.Scalar(h, 2).dtype == torch.float32
        assert torch.ops.aten.norm.ScalarOpt_dim(h, 2, [1]).shape == (4,)
        assert torch.einsum("ij,jk->ik", w, w).dtype == torch.bfloat16
        assert torch.addcmul(h, h, w[:4]).dtype == torch.float32 and torch.addcmul(h, h, h).dtype == torch.bfloat16
        assert torch.cat([h, w[:4]]).dtype == torch.float32  # type promotion of cat itself, no cast
        assert torch.cat([h, h]).dtype == torch.bfloat16
        assert torch.randn(3, dtype=torch.float64).exp().dtype == torch.float64
        with pytest.raises(WorkloadError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.rand(3), torch.rand(3))
