"""SDPA sized as CUDA runs it (issue 40 part 2): the backend CUDA's ``select_sdp_backend`` picks
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), and that backend's saved tensors.

Oracles: the choice table is read off torch's source (each row names the filter that decides);
the saved bytes are counted from autograd's saved tensors (``saved_tensors_hooks``, unique
storages) and compared with the sizes torch's source gives (the memory-efficient kernel's
log-sum-exp padded to 32 rows, ``kAlignLSE`` in ``attention.cu``; the bias padded to 8 columns,
``preprocess_mask`` in ``attention.cpp``), and, for flash, with the CPU's own flash kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_nb import measure, zoo
from memsave_nb.errors import WorkloadError
from memsave_nb.measure.cuda_attention import CUDNN, EFFICIENT, FLASH, MATH, cuda_attention, gpu_of, select_backend
from memsave_nb.workload import Workload

B, H, L = 2, 4, 100


def _qkv(d=64, dtype=torch.bfloat16, lk=L, hk=H, grad=True):
    q = torch.empty(B, H, L, d, dtype=dtype, requires_grad=grad)
    k = torch.empty(B, hk, lk, d, dtype=dtype, requires_grad=grad)
    v = torch.empty(B, hk, lk, d, dtype=dtype, requires_grad=grad)
    return q, k, v


def _choice(gpu, d=64, dtype=torch.bfloat16, mask=False, causal=False, lk=L, dropout=0.0, gqa=False):
    q, k, v = _qkv(d, dtype, lk, hk=2 if gqa else H)
    m = torch.zeros(B, 1, L, lk, dtype=dtype) if mask else None
    return select_backend(q, k, v, m, dropout, causal, gqa, gpu_of(gpu))


@pytest.mark.parametrize(
    "gpu, kwargs, backend",
    [
        ("h100", {}, CUDNN),  # check_prefer_cudnn_attention: sm90 leads with cuDNN
        ("a100", {}, FLASH),  # default order: flash first
        ("a100", dict(gqa=True), FLASH),  # flash takes grouped-query heads
        ("a100", dict(dtype=torch.float32), EFFICIENT),  # check_dtypes_flash_attention: fp16/bf16 only
        ("h100", dict(dtype=torch.float32), EFFICIENT),  # cuDNN: check_dtypes_low_precision
        ("a100", dict(mask=True), EFFICIENT),  # check_for_attn_mask: flash takes no mask
        ("h100", dict(mask=True), CUDNN),  # cuDNN takes the bias
        ("a100", dict(d=60), FLASH),  # flash: head dim <= 256 (padded to 8 by the composite)
        ("h100", dict(d=60), FLASH),  # cuDNN: head dim a multiple of 8
        ("a100", dict(d=300), MATH),  # > 256 for flash; 300 % 8 for memory-efficient
        ("a100", dict(d=512), EFFICIENT),  # memory-efficient has no head-dim limit on CUDA
        ("h100", dict(d=256), CUDNN),  # cuDNN > 9.22 on sm90: head dim 256 forward and backward
        ("h100", dict(d=200), FLASH),  # cuDNN's backward: <= 128, 192/128 or 256/256 only
        ("a100", dict(d=256), FLASH),
        ("a10", dict(d=200), EFFICIENT),  # sm86 training with head dim in (192, 224]
        ("a100", dict(causal=True, lk=64), EFFICIENT),  # flash: causal needs seq_q == seq_k
        ("v100", {}, MATH),  # sm70: bf16 in no fused kernel
        ("v100", dict(dtype=torch.float16), EFFICIENT),  # sm70: no flash, memory-efficient takes fp16
        ("a100", dict(dtype=torch.float64), MATH),
        ("a100", dict(dtype=torch.float32, d=30), MATH),  # memory-efficient: fp32 head dim a multiple of 4
    ],
)
def test_the_backend_cuda_picks(gpu, kwargs, backend):
    assert _choice(gpu, **kwargs) == backend


def _saved_bytes(fn) -> tuple[int, list[tuple]]:
    """Unique storages autograd saves while ``fn`` runs, less the inputs (alive anyway)."""
    saved: dict[int, tuple] = {}

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(id(st), (st, tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        inputs = fn()
    skip = {id(t.untyped_storage()) for t in inputs}
    kept = [v for k, v in saved.items() if k not in skip]
    return sum(st.nbytes() for st, _, _ in kept), [(s, d) for _, s, d in kept]


def _run(gpu, d=64, dtype=torch.bfloat16, mask=None, causal=True):
    with FakeTensorMode():

        def fn():
            q, k, v = (torch.randn(B, H, L, d, dtype=dtype, requires_grad=True) for _ in range(3))
            with cuda_attention(gpu) as mode:
                m = None if mask is None else mask()
                F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal and m is None)
            fn.backends = mode.backends
            return (q, k, v)

        n, shapes = _saved_bytes(fn)
    return n, shapes, fn.backends


def test_memory_efficient_saves_the_padded_lse_and_the_padded_bias():
    """fp32 with a float mask on an A100: output, LSE of ceil(100 / 32) * 32 = 128 rows, the mask
    padded from 100 to 104 columns (its storage), two int64 philox scalars."""
    n, shapes, backends = _run("a100", dtype=torch.float32, mask=lambda: torch.randn(B, 1, L, L))
    assert backends == {EFFICIENT: 1}
    out, lse, bias, philox = B * H * L * 64 * 4, B * H * 128 * 4, B * 1 * L * 104 * 4, 2 * 8
    assert n == out + lse + bias + philox == 292_112
    assert ((B, H, 128), torch.float32) in shapes


def test_a_bool_mask_is_saved_as_an_additive_bias_in_the_query_dtype():
    n, shapes, _ = _run("a100", dtype=torch.float32, mask=lambda: torch.ones(B, 1, L, L, dtype=torch.bool))
    assert n == B * H * L * 64 * 4 + B * H * 128 * 4 + B * L * 104 * 4 + 16


def test_flash_saves_what_the_cpu_flash_kernel_saves_plus_its_rng_state():
    """bf16, causal, no mask on an A100: output and a float32 LSE of batch x heads x seq, the
    same bytes the CPU's own flash kernel saves (the independent count), plus flash's 24 bytes
    of philox state."""
    n, shapes, backends = _run("a100")
    assert backends == {FLASH: 1}
    with FakeTensorMode():

        def cpu():
            q, k, v = (torch.randn(B, H, L, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return (q, k, v)

        cpu_n, _ = _saved_bytes(cpu)
    assert cpu_n == B * H * L * 64 * 2 + B * H * L * 4
    assert n == cpu_n + 24  # philox seed (2 x uint64) and offset (a uint64 scalar)


def test_flash_pads_an_odd_head_dim_to_8_and_keeps_the_copies():
    """``pad_last_dim<8>``: q, k, v of head dim 60 go into the kernel as padded copies (64)."""
    n, shapes, _ = _run("a100", d=60)
    assert n == 3 * B * H * L * 64 * 2 + B * H * L * 64 * 2 + B * H * L * 4 + 24


def test_math_keeps_the_seq_by_seq_probabilities():
    """Head dim 300 in bf16 takes no fused kernel: the math path saves batch x heads x seq x seq."""
    n, shapes, backends = _run("a100", d=300)
    assert backends == {MATH: 1}
    assert ((B, H, L, L), torch.bfloat16) in shapes or ((B, H, L, L), torch.float32) in shapes
    assert n >= B * H * L * L * 2


def _gpt(dtype=torch.float32, head_dim=16, gpu=None):
    cfg = zoo.GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=2, n_embd=2 * head_dim, dropout=0.0)
    w = zoo.gpt(cfg, batch_size=2)
    return Workload(w.model.to(dtype), w.batch, loss=w.loss, sized_for="cuda", gpu=gpu)


def test_a_measured_step_names_the_backend_and_grows_by_the_probabilities():
    """A GPT whose head dim (300) no fused kernel takes is sized with the math path's seq x seq
    probabilities: its peak exceeds the CPU twin's (flash for CPU) by at least one layer's
    probabilities; the first note names the backend."""
    wl = _gpt(torch.bfloat16, head_dim=300, gpu="a100")
    gpu = measure(wl, mode="fake")
    cpu = measure(wl.replace(sized_for=None), mode="fake")
    assert gpu.notes[0].startswith("sized as CUDA runs it: foreach optimizer step, math attention")
    assert gpu.peak_bytes - cpu.peak_bytes >= 2 * 2 * 64 * 64 * 2
    fp32 = measure(_gpt(torch.float32), mode="fake")
    assert "memory-efficient attention" in fp32.notes[0]


def test_the_gpu_is_checked():
    w = zoo.make("mlp", 1)
    with pytest.raises(WorkloadError, match="unknown gpu"):
        Workload(w.model, w.batch, gpu="tpu-v9" * 20)


def test_cudnn_saves_the_flash_bytes_with_its_own_philox_state():
    """bf16 on an H100 takes cuDNN: output and a float32 LSE (batch x heads x seq x 1), two
    int64 philox scalars: the CPU flash kernel's bytes plus 16."""
    n, shapes, backends = _run("h100")
    assert backends == {CUDNN: 1}
    assert ((B, H, L, 1), torch.float32) in shapes
    assert n == B * H * L * 64 * 2 + B * H * L * 4 + 16


def test_a_checkpointed_region_recomputes_with_the_same_backend():
    """The recomputation in backward runs CUDA's backend too (a TorchFunctionMode, off while its
    own handler runs ``backward``, once made checkpoint refuse: 7 tensors saved, then 5)."""
    from torch.utils.checkpoint import checkpoint

    with FakeTensorMode():
        x = torch.randn(B, H, 64, 16, requires_grad=True)
        with cuda_attention("a100") as mode:
            y = checkpoint(
                lambda t: F.scaled_dot_product_attention(t * 2, t * 2, t * 2, is_causal=True), x, use_reentrant=False
            )
            y.sum().backward()
    assert mode.backends == {EFFICIENT: 2}
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # given back


def test_under_autocast_the_backend_sees_the_low_precision_inputs():
    """CUDA's autocast lists ``scaled_dot_product_attention`` as lower precision: fp32 q, k, v (a
    rotary embedding's output) reach the kernel in bf16, so an A100 runs flash, not the fp32
    memory-efficient kernel; the output is bf16."""
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, L, 64, requires_grad=True) for _ in range(3))
        with cuda_attention("a100") as mode, torch.autocast("cpu", dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert mode.backends == {FLASH: 1} and out.dtype == torch.bfloat16
