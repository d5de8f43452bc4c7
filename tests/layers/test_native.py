"""The fused C mask kernels: the same bytes as numpy's packbits, the same gradients as stock's
threshold_backward, chunked over threads, and out of the way wherever they must not run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_nb.layers import _native

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

if not _native.available():
    if os.environ.get("CI"):  # CI installs a compiler: a silent skip there would hide a break
        pytest.fail(f"fused kernels not built in CI: {_native.status()}", pytrace=False)
    pytest.skip(f"fused kernels unavailable: {_native.status()}", allow_module_level=True)


def _special(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[::5] = 0.0
    specials = [float("nan"), -0.0, float("inf"), -float("inf"), -float("nan"),
                torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 4]
    for i, v in enumerate(specials[: max(0, n - 1)]):
        x[i + 1] = v
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4097])
def test_pack_nonzero_writes_numpys_bytes(dtype: torch.dtype, n: int) -> None:
    x = _special(n, dtype, n)
    packed = _native.pack_nonzero(x)
    want = np.packbits(x.bool().numpy(), bitorder="little")  # what the numpy path keeps
    assert packed is not None and packed.dtype == torch.uint8
    assert packed.numel() == -(-n // 8)
    assert np.array_equal(packed.numpy(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4097])
def test_select_bits_is_threshold_backward_on_a_mask(dtype: torch.dtype, n: int) -> None:
    out = _special(n, dtype, 7 * n).relu()
    grad = _special(n, dtype, 11 * n)  # NaN, inf and -0 gradients, where passed and where not
    selected = _native.select_bits(grad, _native.pack_nonzero(out))
    stock = torch.ops.aten.threshold_backward(grad, out, 0)  # stock ReLU's backward
    assert selected.dtype == grad.dtype and selected.shape == grad.shape
    torch.testing.assert_close(selected, stock, rtol=0, atol=0, equal_nan=True)
    stopped = out == 0  # where stock writes +0, so do we (not -0, not the gradient's bits)
    assert not selected[stopped].signbit().any()


def test_chunks_over_threads_give_the_same_bytes() -> None:
    n = 5 * _native._MIN_CHUNK + 13  # several chunks, the last one ragged
    x = _special(n, torch.float32, 3).relu()
    grad = torch.randn(n)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert len(_native._chunks(n)) == 1
        one = _native.pack_nonzero(x), None
        one = one[0], _native.select_bits(grad, one[0])
        torch.set_num_threads(4)
        pieces = _native._chunks(n)
        assert len(pieces) == 4 and sum(c for _, c in pieces) == n
        assert all(start % 64 == 0 for start, _ in pieces)
        four = _native.pack_nonzero(x)
        assert torch.equal(four, one[0])
        assert torch.equal(_native.select_bits(grad, four), one[1])
    finally:
        torch.set_num_threads(before)


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_kernels_stand_aside_where_they_must_not_run() -> None:
    x = torch.randn(64).relu()
    packed = _native.pack_nonzero(x)
    grad = torch.randn(64)
    assert _native.pack_nonzero(x[::2]) is None  # not contiguous: logical order is not memory order
    assert _native.select_bits(grad.expand(2, 64)[0:1].t().reshape(64, 1).expand(64, 2), packed) is None
    assert _native.select_bits(grad, packed[:-1]) is None  # wrong mask size
    assert _native.pack_nonzero(torch.ones(64, dtype=torch.int32)) is None  # not a float
    assert _native.select_bits(torch._neg_view(grad), packed) is None  # its bytes are not its values
    with _Seen():  # a tracker (any dispatch mode) must see every allocation: torch ops only
        assert _native.pack_nonzero(x) is None
        assert _native.select_bits(grad, packed) is None
    with torch.enable_grad():  # create_graph: the gradient must stay differentiable
        assert _native.select_bits(grad.clone().requires_grad_(True), packed) is None
    assert _native.select_bits(grad.clone().requires_grad_(True).detach(), packed) is not None
    with torch.device("meta"):
        assert _native.pack_nonzero(torch.empty(64)) is None


class _Twice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


@pytest.mark.parametrize("layer", [nn.ReLU(), nn.ReLU(inplace=True), nn.ReLU6(),
                                   nn.Hardtanh(-0.5, 2.0)])
def test_layers_take_the_fused_path_and_match_stock(monkeypatch, layer) -> None:
    """A converted activation whose output nobody else keeps backs its gradient through the
    fused kernel (counted), bit for bit as stock."""
    from memsave_nb.layers import activation, convert, revert

    calls = {"select": 0}
    real = activation.select_bits

    def counting(grad, packed):
        out = real(grad, packed)
        calls["select"] += out is not None
        return out

    monkeypatch.setattr(activation, "select_bits", counting)
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0)) * 3
    g = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(_Twice(), layer, _Twice())  # nothing keeps the activation's output
    leaf = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(model(leaf * 1), leaf, g)
    conversion = convert(model)
    try:
        leaf = x.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(model(leaf * 1), leaf, g)
    finally:
        revert(conversion)
    assert calls["select"] == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.abs().sum() > 0 and (got == 0).any()  # some passed, some stopped


def test_switched_off_by_the_environment() -> None:
    code = ("from memsave_nb.layers import _native; import torch;"
            "print(_native.status()); print(_native.pack_nonzero(torch.ones(9)))")
    env = dict(os.environ, MEMSAVE_NB_NATIVE="0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    assert done.stdout.splitlines() == ["off (MEMSAVE_NB_NATIVE=0)", "None"]


def test_a_cache_folder_others_can_write_is_not_trusted(tmp_path) -> None:
    """A library planted in a group/world-writable cache folder would run as the user: the
    loader builds into a private folder instead, and never opens the planted file."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    planted = shared / _native.library_name(_native._compiler())
    planted.write_bytes(b"not a library")  # loading it would fail loudly (OSError)
    code = ("from memsave_nb.layers import _native; import torch;"
            "print(_native.status()); print(_native.pack_nonzero(torch.ones(9)).tolist())")
    env = dict(os.environ, MEMSAVE_NB_CACHE=str(shared))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    assert done.stdout.splitlines() == ["built", "[255, 1]"]
    assert planted.read_bytes() == b"not a library"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_gets_its_own_thread_pool() -> None:
    """A DataLoader worker is a fork: it inherits the pool object without its threads, and
    chunks submitted to a pool whose (vanished) workers are all counted can wait forever
    (``ThreadPoolExecutor`` only starts a thread when it counts fewer than its maximum). The
    child must make a pool of its own, and get the same bytes through it."""
    n = 4 * _native._MIN_CHUNK
    x = torch.randn(n).relu()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        want = _native.pack_nonzero(x)  # the parent's pool now exists
        inherited = _native._pool
        assert inherited is not None
        pid = os.fork()
        if pid == 0:  # child: exit 0 only with a new pool and the same bytes
            ok = False
            try:
                got = _native.pack_nonzero(x)
                ok = _native._pool is not inherited and np.array_equal(got.numpy(), want.numpy())
            finally:
                os._exit(0 if ok else 1)
        start = time.monotonic()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > 60:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on the parent's thread pool")
            time.sleep(0.05)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert _native._pool is inherited  # the parent keeps its own
    finally:
        torch.set_num_threads(before)
