"""The fused C mask kernels: the same bytes as numpy's packbits, the same gradients as stock's
threshold_backward, chunked over threads, and out of the way wherever they must not run."""

from __future__ import annotations

import os
import platform
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


def _count_runs(monkeypatch, module, name: str) -> dict[str, int]:
    """Wrap ``module.name`` (a kernel entry that returns None where it stands aside) and count
    the calls where it ran."""
    seen = {name: 0}
    real = getattr(module, name)

    def counting(*args):
        out = real(*args)
        seen[name] += out is not None
        return out

    monkeypatch.setattr(module, name, counting)
    return seen


def _special(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[::5] = 0.0
    specials = [
        float("nan"),
        -0.0,
        float("inf"),
        -float("inf"),
        -float("nan"),
        torch.finfo(dtype).tiny / 4,
        -torch.finfo(dtype).tiny / 4,
    ]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000, 4097])
def test_scale_bits_is_stock_leaky_relu_and_dropout_backward(dtype: torch.dtype, n: int) -> None:
    grad = _special(n, dtype, 13 * n)  # NaN, inf, -0 and denormal gradients on both sides
    grad[-1] = torch.finfo(dtype).max  # overflows times the dropout scale, not times 0
    keep = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.6
    packed = _native.pack_nonzero(keep.to(dtype))
    mask = keep.to(dtype)
    for slope in (0.01, 0.2, -0.5, 0.0):  # leaky ReLU: the input > 0 test as the mask
        got = _native.scale_bits(grad, packed, 1.0, slope)
        want = torch.ops.aten.leaky_relu_backward(grad, mask, slope, False)
        assert got.dtype == dtype and got.shape == grad.shape
        assert torch.equal(_bytes(got), _bytes(want)), slope
    for p in (0.1, 0.5, 0.9):  # dropout: stock keeps noise = scale or 0 and returns grad * noise
        scale = torch.ones((), dtype=dtype).div_(1 - p)
        noise = mask * scale
        got = _native.scale_bits(grad, packed, scale.item(), 0.0)
        assert torch.equal(_bytes(got), _bytes(grad * noise)), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4097])
def test_pack_positive_writes_the_bytes_of_numpys_comparison(dtype: torch.dtype, n: int) -> None:
    x = _special(n, dtype, 19 * n)  # NaN of both signs, -0, +0, infs, denormals
    packed = _native.pack_positive(x)
    want = np.packbits(np.greater(x.numpy(), 0), bitorder="little")  # the numpy path's mask
    assert packed is not None and packed.numel() == -(-n // 8)
    assert np.array_equal(packed.numpy(), want)
    y = torch.randn(64, dtype=dtype)
    assert _native.pack_positive(y.half()) is None and _native.pack_positive(y[::2]) is None
    with _Seen():
        assert _native.pack_positive(y) is None


def test_scale_bits_stands_aside_where_it_must_not_run() -> None:
    grad = torch.randn(64)
    packed = _native.pack_nonzero(torch.randn(64).relu())
    assert _native.scale_bits(grad.half(), packed, 1.0, 0.1) is None  # float32/64 only
    assert _native.scale_bits(grad, packed[:-1], 1.0, 0.1) is None  # wrong mask size
    assert _native.scale_bits(grad[::2].repeat(2)[::2], packed[:4], 1.0, 0.1) is None
    assert _native.scale_bits(torch._neg_view(grad), packed, 1.0, 0.1) is None
    with _Seen():
        assert _native.scale_bits(grad, packed, 1.0, 0.1) is None
    with torch.enable_grad():  # create_graph: the gradient must stay differentiable
        assert _native.scale_bits(grad.clone().requires_grad_(True), packed, 1.0, 0.1) is None
    assert _native.scale_bits(grad, packed, 1.0, 0.1) is not None


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
        torch.set_num_threads(1)
        scaled = _native.scale_bits(grad, four, 1.25, -0.5)
        torch.set_num_threads(4)
        assert torch.equal(_native.scale_bits(grad, four, 1.25, -0.5), scaled)
    finally:
        torch.set_num_threads(before)


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("inplace", [False, True])
def test_relu_pack_writes_torch_relus_bytes_and_their_bits(dtype: torch.dtype, n: int, inplace: bool) -> None:
    x = _special(n, dtype, 3 * n)  # NaN of both signs, -0, infs, denormals, negatives
    want = torch.relu(x)
    want_bits = np.packbits(want.bool().numpy(), bitorder="little")
    source = x.clone()
    fused = _native.relu_pack(source, inplace)
    assert fused is not None
    out, packed = fused
    assert (out is source) == inplace
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(_bytes(out), _bytes(want))  # -0 stays -0, NaN payloads pass, -x -> +0
    if not inplace:
        assert torch.equal(_bytes(source), _bytes(x))  # the input untouched
    assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), want_bits)


def test_relu_pack_chunked_over_threads_gives_the_same_bytes() -> None:
    n = 5 * _native._MIN_CHUNK + 13
    x = _special(n, torch.float32, 5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native.relu_pack(x, False)
        torch.set_num_threads(3)
        assert len(_native._chunks(n)) == 3
        many = _native.relu_pack(x, False)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bytes(one[0]), _bytes(many[0]))
    assert torch.equal(one[1], many[1])
    assert torch.equal(_bytes(one[0]), _bytes(torch.relu(x)))


def _levels() -> list[int]:
    """Every float32 body this CPU runs (0 baseline, 1 AVX2, 2 AVX-512)."""
    top = _native.simd_level()
    return list(range(top + 1))


@pytest.fixture(params=[0, 1, 2], ids=_native.SIMD_NAMES)
def simd(request):
    """Run the test with the float32 kernels capped at one SIMD level, if the CPU has it."""
    top = _native.simd_level()
    if request.param > top:
        pytest.skip(f"this CPU runs up to {_native.SIMD_NAMES[top]}")
    try:
        assert _native.simd_level(request.param) == request.param
        yield request.param
    finally:
        _native.simd_level(2)  # back to the CPU's best
    assert _native.simd_level() == top


# sizes around every body's step (8 baseline/AVX2, 16 AVX-512) and a ragged tail
_SIMD_SIZES = [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 1000, 4097]


@pytest.mark.parametrize("n", _SIMD_SIZES)
def test_every_simd_level_writes_the_same_bytes(simd, n: int) -> None:
    """relu_pack, pack_nonzero, select_bits and scale_bits at each SIMD level: torch.relu's
    bytes, numpy's packbits, threshold_backward's, leaky_relu_backward's and dropout's
    gradients; the specials (NaN of both signs, -0, infs,
    denormals) placed at every position of a 16-element step."""
    x = _special(n, torch.float32, 13 * n)
    for shift in range(0, min(n, 16), 5):  # move the specials across the vector lanes
        shifted = torch.roll(x, shift)
        want = torch.relu(shifted)
        want_bits = np.packbits(want.bool().numpy(), bitorder="little")
        out, packed = _native.relu_pack(shifted.clone(), True)
        assert torch.equal(_bytes(out), _bytes(want))
        assert np.array_equal(packed.numpy(), want_bits)
        assert np.array_equal(_native.pack_nonzero(want).numpy(), want_bits)
        grad = _special(n, torch.float32, 17 * n + shift)
        selected = _native.select_bits(grad, packed)
        stock = torch.ops.aten.threshold_backward(grad, want, 0)
        assert torch.equal(_bytes(selected), _bytes(torch.where(want != 0, grad, 0.0)))
        torch.testing.assert_close(selected, stock, rtol=0, atol=0, equal_nan=True)
        assert np.array_equal(
            _native.pack_positive(shifted).numpy(), np.packbits(np.greater(shifted.numpy(), 0), bitorder="little")
        )
        mask = (want != 0).to(torch.float32)  # leaky ReLU's and dropout's scaling
        leaky = _native.scale_bits(grad, packed, 1.0, 0.01)
        assert torch.equal(_bytes(leaky), _bytes(torch.ops.aten.leaky_relu_backward(grad, mask, 0.01, False)))
        scale = torch.ones(()).div_(0.7)
        dropped = _native.scale_bits(grad, packed, scale.item(), 0.0)
        assert torch.equal(_bytes(dropped), _bytes(grad * (mask * scale)))


def test_the_simd_level_is_the_cpus_best_by_default() -> None:
    """The level in force is the best this CPU supports (AVX-512 here if the CPU has avx512f:
    Linux lists it in /proc/cpuinfo), and a cap above it cannot raise it."""
    top = _native.simd_level()
    assert top in (0, 1, 2)
    assert _native.simd_level(2) == top
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    if flags and platform.machine() in ("x86_64", "AMD64"):
        names = set(flags.split())
        want = 2 if "avx512f" in names else 1 if "avx2" in names else 0
        assert top == want


def test_relu_pack_stands_aside_where_it_must_not_run() -> None:
    x = torch.randn(64)
    assert _native.relu_pack(x.to(torch.bfloat16), False) is None  # relu + pack_nonzero there
    assert _native.relu_pack(x.to(torch.float16), True) is None
    assert _native.relu_pack(x[::2], False) is None  # not contiguous
    assert _native.relu_pack(torch._neg_view(x), False) is None  # its bytes are not its values
    with _Seen():  # a tracker must see the ops
        assert _native.relu_pack(x, False) is None
    with torch.device("meta"):
        assert _native.relu_pack(torch.empty(64), True) is None


def test_a_relu_left_alone_runs_relu_and_packing_in_one_pass(monkeypatch) -> None:
    """From its second step a ReLU whose output nobody else keeps runs the one-pass kernel
    (counted): the same forward bytes and the same gradients as stock, in place or not."""
    from memsave_nb.layers import activation, convert, revert

    calls = _count_runs(monkeypatch, activation, "relu_pack")
    x = _special(4 * 8 * 16 * 16, torch.float32, 9).view(4, 8, 16, 16) * 3
    g = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    for inplace in (False, True):
        model = nn.Sequential(_Twice(), nn.ReLU(inplace=inplace), _Twice())
        seen: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        leaf = x.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(model(leaf * 1), leaf, g)
        want_out = seen[-1]
        conversion = convert(model)
        try:
            for step in range(3):
                leaf = x.clone().requires_grad_(True)
                (got,) = torch.autograd.grad(model(leaf * 1), leaf, g)
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
                assert torch.equal(_bytes(seen[-1]), _bytes(want_out))
        finally:
            revert(conversion)
    assert calls["relu_pack"] == 4  # steps 2 and 3, both variants (step 1 holds the output)


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


@pytest.mark.parametrize("layer", [nn.ReLU(), nn.ReLU(inplace=True), nn.ReLU6(), nn.Hardtanh(-0.5, 2.0)])
def test_layers_take_the_fused_path_and_match_stock(monkeypatch, layer) -> None:
    """A converted activation whose output nobody else keeps backs its gradient through the
    fused kernel (counted), bit for bit as stock."""
    from memsave_nb.layers import activation, convert, revert

    calls = _count_runs(monkeypatch, activation, "select_bits")
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
    assert calls["select_bits"] == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.abs().sum() > 0 and (got == 0).any()  # some passed, some stopped


@pytest.mark.parametrize(
    "layer",
    [
        nn.LeakyReLU(0.1),
        nn.LeakyReLU(0.1, inplace=True),
        nn.LeakyReLU(-0.3),
        nn.Dropout(0.3),
        nn.Dropout(0.3, inplace=True),
        nn.AlphaDropout(0.2),
    ],
    ids=lambda m: repr(m),
)
def test_leaky_relu_and_dropout_take_the_scaling_kernel_and_match_stock(monkeypatch, layer) -> None:
    """A converted leaky ReLU whose output nobody else keeps, and a converted dropout, back
    their gradient through the fused scaling kernel (counted), bit for bit as stock under the
    same seed; dropout's mask is packed from its noise in one pass (counted)."""
    from memsave_nb.layers import activation, convert, dropout, revert

    module = activation if isinstance(layer, nn.LeakyReLU) else dropout
    calls = _count_runs(monkeypatch, module, "scale_bits")
    packs = _count_runs(monkeypatch, dropout, "pack_nonzero")
    positives = _count_runs(monkeypatch, activation, "pack_positive")
    held = _count_runs(monkeypatch, activation._holder, "pack_positive")
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0)) * 3
    g = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    g[0, 0, 0, :4] = torch.tensor([float("inf"), float("nan"), -0.0, -float("inf")])
    model = nn.Sequential(_Twice(), layer, _Twice())  # nothing keeps the activation's output

    def grads() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(5)
        leaf = x.clone().requires_grad_(True)
        out = model(leaf * 1)
        (got,) = torch.autograd.grad(out, leaf, g)
        return out.detach(), got

    want_out, want = grads()
    conversion = convert(model)
    try:
        got_out, got = grads()
    finally:
        revert(conversion)
    assert calls["scale_bits"] == 1
    assert packs["pack_nonzero"] == (0 if module is activation else 1)
    # leaky: its input's mask in one pass, in forward (negative slope: not held) or from the
    # held output once nobody else keeps it (positive slope)
    if module is activation:
        assert positives["pack_positive"] + held["pack_positive"] == 1
    assert torch.equal(_bytes(got_out), _bytes(want_out))
    assert torch.equal(_bytes(got), _bytes(want))


@pytest.mark.parametrize("layer", [nn.Dropout(0.3), nn.AlphaDropout(0.2), nn.Dropout2d(0.3)], ids=lambda m: repr(m))
@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "torch ops"])
def test_dropout_backward_is_stocks_grad_times_noise_on_both_paths(monkeypatch, layer, fused: bool) -> None:
    """With and without the kernel, dropout's gradient is stock's ``grad * noise`` byte for
    byte, including a gradient so large that times the scale it overflows where the element
    is dropped (stock: grad * 0 = 0; scaling first and masking after would give NaN)."""
    from memsave_nb.layers import convert, dropout, revert

    if not fused:
        monkeypatch.setattr(dropout, "scale_bits", lambda *args: None)
    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    g = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    g.view(-1)[::7] = torch.finfo(torch.float32).max  # overflows times 1 / (1 - p)
    g.view(-1)[1::7] = -0.0

    def grads() -> torch.Tensor:
        torch.manual_seed(5)
        leaf = x.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(layer(leaf * 1), leaf, g)
        return got

    want = grads()
    conversion = convert(nn.Sequential(layer))
    try:
        got = grads()
    finally:
        revert(conversion)
    assert torch.equal(_bytes(got), _bytes(want))
    assert not got.isnan().any()  # dropped: 0, not NaN
    if not isinstance(layer, nn.AlphaDropout):  # (alpha dropout scales by less than 1)
        assert got.isinf().any()  # kept: overflowed to inf, as in stock


def test_switched_off_by_the_environment() -> None:
    code = (
        "from memsave_nb.layers import _native; import torch;"
        "print(_native.status()); print(_native.pack_nonzero(torch.ones(9)))"
    )
    env = dict(os.environ, MEMSAVE_NB_NATIVE="0")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert done.stdout.splitlines() == ["off (MEMSAVE_NB_NATIVE=0)", "None"]


def test_a_cache_folder_others_can_write_is_not_trusted(tmp_path) -> None:
    """A library planted in a group/world-writable cache folder would run as the user: the
    loader builds into a private folder instead, and never opens the planted file."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    planted = shared / _native.library_name(_native._compiler())
    planted.write_bytes(b"not a library")  # loading it would fail loudly (OSError)
    code = (
        "from memsave_nb.layers import _native; import torch;"
        "print(_native.status()); print(_native.pack_nonzero(torch.ones(9)).tolist())"
    )
    env = dict(os.environ, MEMSAVE_NB_CACHE=str(shared))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
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


_POOLS = [  # (spatial input, kernel, stride, padding, dilation, ceil_mode)
    ((17,), [3], [2], [1], [1], False),
    ((16,), [4], [3], [0], [2], True),
    ((9, 11), [3, 3], [2, 2], [1, 1], [1, 1], False),
    ((12, 10), [2, 3], [2, 1], [0, 1], [2, 1], True),
    ((28, 28), [2, 2], [2, 2], [0, 0], [1, 1], False),
    ((5, 6, 7), [2, 3, 2], [1, 2, 2], [1, 1, 0], [1, 1, 2], True),
    ((40, 40), [17, 17], [3, 3], [8, 8], [1, 1], False),  # 289-element windows: int16 offsets
]


@pytest.mark.parametrize("geometry", _POOLS)
def test_pool_offsets_match_the_torch_ops_both_ways(geometry) -> None:
    from memsave_nb.layers import pool

    spatial, kernel, stride, padding, dilation, ceil_mode = geometry
    n = len(kernel)
    x = torch.randn(3, 4, *spatial, generator=torch.Generator().manual_seed(len(spatial)))
    x[0, 0].fill_(1.0)  # ties: the first maximum in window order is the argmax
    out, flat = pool._POOL[n](x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    window = 1
    for k in kernel:
        window *= k
    dtype = pool.window_index_dtype(window)
    out_spatial = out.shape[-n:]
    deltas = pool._kernel_deltas(spatial, kernel, dilation)
    assert deltas is not None
    fused = _native.pool_offsets(flat, out_spatial, spatial, stride, padding, deltas, dtype)
    torch_ops = pool._window_offsets(flat.clone(), out_spatial, spatial, kernel, stride, padding, dilation, dtype)
    assert fused is not None and fused.dtype == torch_ops.dtype == dtype
    assert torch.equal(fused, torch_ops)
    back = _native.pool_flat(fused, out_spatial, spatial, stride, padding, deltas)
    assert back is not None and back.dtype == torch.int64
    assert torch.equal(back, flat)  # the very indices stock's backward reads
    assert torch.equal(back, pool._flat_indices(fused, out_spatial, spatial, kernel, stride, padding, dilation))


def test_pool_kernels_stand_aside_where_they_must_not_run() -> None:
    flat = torch.zeros(2, 3, 4, 4, dtype=torch.int64)
    geometry = ((4, 4), (8, 8), [2, 2], [0, 0], [0, 1, 8, 9])
    assert _native.pool_offsets(flat, *geometry, torch.uint8) is None  # indices off their windows
    flat = torch.tensor([0, 1, 8, 9], dtype=torch.int64).repeat(2, 3, 4, 1).reshape(2, 3, 4, 4)
    flat += (torch.arange(4) * 16).view(4, 1) + (torch.arange(4) * 2)  # each window's start
    local = _native.pool_offsets(flat, *geometry, torch.uint8)
    assert local is not None and torch.equal(local[0, 0, 0], torch.tensor([0, 1, 2, 3], dtype=torch.uint8))
    assert torch.equal(_native.pool_flat(local, *geometry), flat)
    assert _native.pool_offsets(flat, *geometry[:4], None, torch.uint8) is None  # no deltas
    assert _native.pool_offsets(flat.transpose(2, 3), *geometry, torch.uint8) is None
    assert _native.pool_offsets(flat.int(), *geometry, torch.uint8) is None  # not stock's int64
    assert _native.pool_offsets(flat, *geometry, torch.int64) is None
    with _Seen():  # a tracker must see the ops
        assert _native.pool_offsets(flat, *geometry, torch.uint8) is None
        assert _native.pool_flat(flat.to(torch.uint8), *geometry) is None
    local = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    assert _native.pool_flat(local.transpose(2, 3), *geometry) is None


def test_a_converted_max_pool_converts_its_indices_in_c(monkeypatch) -> None:
    """The layer takes the one-pass conversions both ways (counted), with stock's output and
    gradients bit for bit."""
    from memsave_nb.layers import convert, pool, revert

    offsets = _count_runs(monkeypatch, pool, "pool_offsets")
    flats = _count_runs(monkeypatch, pool, "pool_flat")
    model = nn.Sequential(_Twice(), nn.MaxPool2d(3, 2, 1), _Twice())
    x = torch.randn(2, 4, 15, 15, generator=torch.Generator().manual_seed(3))
    x[:, :, :4, :4] = 0.5  # ties
    g = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    leaf = x.clone().requires_grad_(True)
    want_out = model(leaf * 1)
    (want,) = torch.autograd.grad(want_out, leaf, g)
    conversion = convert(model)
    try:
        leaf = x.clone().requires_grad_(True)
        got_out = model(leaf * 1)
        (got,) = torch.autograd.grad(got_out, leaf, g)
    finally:
        revert(conversion)
    assert offsets["pool_offsets"] == flats["pool_flat"] == 1
    assert torch.equal(got_out, want_out)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
