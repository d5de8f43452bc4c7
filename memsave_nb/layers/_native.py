"""Fused 1-bit mask kernels in C (``_native.c``), built on first use with the system's C
compiler and called through ctypes, for plain contiguous CPU tensors; the same library holds the
ReLU-and-mask pass (:func:`relu_pack`), the leaky ReLU's and dropout's masked scaling in backward
(:func:`scale_bits`) and the max pool's argmax <-> window-offset conversions
(:func:`pool_offsets`, :func:`pool_flat`), which replace several torch ops each.

Why: a ReLU whose output is not kept by anyone else backs its gradient from a packed mask.
With torch and numpy ops that takes three passes over memory in backward (unpack the bits to
bytes, cast them to the gradient's dtype, ``threshold_backward``), about twice the traffic of
stock's one pass over the kept output, and on the paper's ResNet cases the step stayed 7-18%
slower than stock. One fused pass reads the gradient and N/8 bytes of bits and writes the
result: less traffic than stock's backward, which reads a whole float output.

What a tracker counts is unchanged: the kernels run only where :func:`._bits.numpy_ok` holds
(no dispatch mode, no compiler, a plain CPU tensor), and then no tracker is looking. Under a
tracker the torch-op path runs, whose backward temporaries (the unpacked mask, N bytes, and its
cast, one gradient-sized tensor) are the upper bound of what the fused step makes (none).

The library is built for the baseline of the machine's architecture; on x86 its float32 bodies
also come in AVX2 and AVX-512 versions (per-function ``target`` attributes), picked at run time
from what the CPU reports (:func:`simd_level`), since stock's own kernels use the widest the CPU
has and a narrower mask pass was the slower half of the layer.

Nothing changes in the results: the kernels write the same bytes as the numpy path (tested
byte for byte, at every SIMD level the CPU has). Where no library can be built (no compiler,
``MEMSAVE_NB_NATIVE=0``) the numpy path runs, only slower; :func:`status` says which and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from ._bits import numpy_ok, packed_nbytes

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c99"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": CDLL or None, "why": str

# below this many elements per thread a single call beats handing chunks to threads
_MIN_CHUNK = 1 << 17
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_pid = 0  # a forked child (a DataLoader worker) inherits the pool object but not its threads


def _cache_dir() -> Path:
    explicit = os.environ.get("MEMSAVE_NB_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "memsave_nb"


def _trusted(folder: Path) -> bool:
    """A folder we may load a library from: ours, and writable by no one else (a library
    planted there by another user would run as us)."""
    try:
        st = folder.stat()
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return mine and not (st.st_mode & 0o022)


def _compile(compiler: str, folder: Path, target: Path, suffix: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=suffix, dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-300:]}")
        os.replace(tmp, target)  # atomic: concurrent builders leave one whole file
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_name(compiler: str) -> str:
    """The cached library's file name: keyed by source, compiler, flags and machine."""
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join([compiler, *_FLAGS, platform.machine(), sys.platform]).encode()
    ).hexdigest()[:16]
    return f"native-{key}" + (".dll" if sys.platform == "win32" else ".so")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    """Compile the source into the user's cache (once per source, compiler, flags and machine),
    or, where that folder is not ours alone or not writable, into a private temporary folder."""
    name = library_name(compiler)
    suffix = Path(name).suffix
    folder = _cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if _trusted(folder) and os.access(folder, os.W_OK):
        target = folder / name
        if target.exists() and _owned(target):
            return target
        return _compile(compiler, folder, target, suffix)
    private = Path(tempfile.mkdtemp(prefix="memsave_nb-"))  # 0700, this process's own
    return _compile(compiler, private, private / name, suffix)


def _owned(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not (st.st_mode & 0o022)


def _load() -> ctypes.CDLL | None:
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib, why = None, "built"
        if os.environ.get("MEMSAVE_NB_NATIVE", "1") == "0":
            why = "off (MEMSAVE_NB_NATIVE=0)"
        else:
            compiler = _compiler()
            if compiler is None:
                why = "no C compiler (cc, gcc or $CC) found"
            else:
                try:
                    lib = ctypes.CDLL(str(_build(compiler)))
                    for name in (
                        "memsave_pack_nonzero",
                        "memsave_select_bits",
                        "memsave_relu_pack",
                        "memsave_pool_offsets",
                        "memsave_pool_flat",
                        "memsave_simd_level",
                        "memsave_scale_bits",
                        "memsave_pack_positive",
                    ):
                        getattr(lib, name).restype = ctypes.c_int
                    lib.memsave_simd_level.argtypes = [ctypes.c_int]
                    lib.memsave_pack_nonzero.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
                    lib.memsave_pack_positive.argtypes = lib.memsave_pack_nonzero.argtypes
                    p64 = ctypes.POINTER(ctypes.c_int64)
                    p32 = ctypes.POINTER(ctypes.c_int32)
                    lib.memsave_pool_offsets.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_int64,
                        ctypes.c_int,
                        p64,
                        p64,
                        p64,
                        p64,
                        p32,
                        ctypes.c_int64,
                        ctypes.c_int,
                        ctypes.c_void_p,
                    ]
                    lib.memsave_pool_flat.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_int,
                        ctypes.c_int64,
                        ctypes.c_int,
                        p64,
                        p64,
                        p64,
                        p64,
                        p64,
                        ctypes.c_int64,
                        ctypes.c_void_p,
                    ]
                    lib.memsave_relu_pack.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_int64,
                        ctypes.c_int,
                        ctypes.c_void_p,
                        ctypes.c_void_p,
                    ]
                    lib.memsave_select_bits.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_void_p,
                        ctypes.c_int64,
                        ctypes.c_int,
                        ctypes.c_void_p,
                    ]
                    lib.memsave_scale_bits.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_void_p,
                        ctypes.c_int64,
                        ctypes.c_int,
                        ctypes.c_double,
                        ctypes.c_double,
                        ctypes.c_void_p,
                    ]
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    lib, why = None, f"build failed: {err}"
        _state["why"] = why
        _state["lib"] = lib
        return lib


def status() -> str:
    """'built', or why the fused kernels are not in use (then the numpy path runs)."""
    _load()
    return str(_state["why"])


def available() -> bool:
    return _load() is not None


SIMD_NAMES = ("baseline", "avx2", "avx512")


def simd_level(cap: int | None = None) -> int:
    """The float32 kernel bodies in use: 0 baseline (SSE2 or plain C), 1 AVX2, 2 AVX-512, as
    the CPU allows. ``cap`` lowers the level (or restores it, up to the CPU's) for every later
    call in this process: tests run each body, and a bench compares them. All write the same
    bytes. -1 where no library is built."""
    lib = _load()
    if lib is None:
        return -1
    return int(lib.memsave_simd_level(-1 if cap is None else int(cap)))


# the float dtypes the kernels take (by element size: they handle elements by their bytes)
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _usable(t: Tensor) -> bool:
    # a negative view shares memory with its base and flips signs lazily: its bytes are not
    # its values, so the kernels (which read bytes) must not take it. (numpy_ok before the
    # tensor queries: under torch.compile those would break the graph.)
    return t.dtype in _FLOATS and numpy_ok(t) and t.is_contiguous() and not t.is_neg()


def _chunks(n: int) -> list[tuple[int, int]]:
    """(start, count) pieces, each a multiple of 64 elements but the last, one per thread."""
    parts = min(torch.get_num_threads(), n // _MIN_CHUNK)
    if parts <= 1:
        return [(0, n)]
    step = ((-(-n // parts)) + 63) & ~63
    return [(start, min(step, n - start)) for start in range(0, n, step)]


def _run(calls: list) -> None:
    """Run the chunk calls: the first here, the rest on a pool (ctypes lets go of the GIL)."""
    global _pool, _pool_size, _pool_pid
    if len(calls) == 1:
        calls[0]()
        return
    with _lock:
        if _pool is None or _pool_size < len(calls) - 1 or _pool_pid != os.getpid():
            # the old pool is not shut down: another thread may be submitting to it right now;
            # its idle workers end when it is garbage collected
            _pool_size = len(calls) - 1
            _pool_pid = os.getpid()
            _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="memsave-bits")
        pool = _pool
    futures = [pool.submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


def pack_nonzero(t: Tensor) -> Tensor | None:
    """Packed bits of ``t != 0`` (as ``t.bool()``: NaN passes, both zeros do not), or None
    where the kernels cannot run on ``t``."""
    lib = _load()
    if lib is None or not _usable(t):
        return None
    return _pack(lib.memsave_pack_nonzero, t)


def _pack(fn, t: Tensor) -> Tensor:
    """Run a packing kernel ``fn(src, n, elem_size, dst)`` over ``t`` (checked by the caller)
    into a fresh flat uint8 tensor of ceil(n / 8) bytes, in chunks over threads."""
    n = t.numel()
    packed = torch.empty(packed_nbytes(n), dtype=torch.uint8)
    size = t.element_size()
    src, dst = t.data_ptr(), packed.data_ptr()
    if n < 2 * _MIN_CHUNK or torch.get_num_threads() == 1:  # one chunk: call it directly
        fn(src, n, size, dst)
        return packed
    _run([lambda s=s, c=c: fn(src + s * size, c, size, dst + s // 8) for s, c in _chunks(n)])
    return packed


_RELU_FLOATS = frozenset({torch.float32, torch.float64})


def pack_positive(t: Tensor) -> Tensor | None:
    """Packed bits of ``t > 0`` (leaky ReLU's mask of its input: false for NaN and both zeros,
    as numpy's and stock's comparison), in one pass; float32/64 only, None where the kernel
    cannot run (then the caller compares and packs)."""
    lib = _load()
    if lib is None or t.dtype not in _RELU_FLOATS or not _usable(t):
        return None
    return _pack(lib.memsave_pack_positive, t)


def relu_pack(x: Tensor, inplace: bool) -> tuple[Tensor, Tensor] | None:
    """``torch.relu(x)`` (into ``x`` itself when ``inplace``; the caller marks it dirty) and
    the packed bits of its nonzeros, in one pass; None where the kernel cannot run on ``x``
    (then the caller runs ``relu`` and :func:`pack_nonzero`). The output's bytes are
    torch.relu's: negatives become +0, -0 and NaN pass unchanged."""
    lib = _load()
    if lib is None or x.dtype not in _RELU_FLOATS or not numpy_ok(x) or not x.is_contiguous() or x.is_neg():
        return None
    n = x.numel()
    out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    packed = torch.empty(packed_nbytes(n), dtype=torch.uint8)
    size = x.element_size()
    src, dst, bits = x.data_ptr(), out.data_ptr(), packed.data_ptr()
    fn = lib.memsave_relu_pack
    if n < 2 * _MIN_CHUNK or torch.get_num_threads() == 1:  # one chunk: call it directly
        fn(src, n, size, dst, bits)
    else:
        _run([lambda s=s, c=c: fn(src + s * size, c, size, dst + s * size, bits + s // 8) for s, c in _chunks(n)])
    return out, packed


def select_bits(grad: Tensor, packed: Tensor) -> Tensor | None:
    """``grad`` where the packed bit is 1, +0 elsewhere, in one pass (what
    ``threshold_backward(grad, mask, 0)`` gives for a 0/1 mask), or None where the kernels
    cannot run (then the caller unpacks)."""
    return _masked_pass("memsave_select_bits", grad, packed)


def scale_bits(grad: Tensor, packed: Tensor, on: float, off: float) -> Tensor | None:
    """``grad * on`` where the packed bit is 1 and ``grad * off`` elsewhere, in one pass, in
    the gradient's dtype (``on == 1``: the gradient itself there). Leaky ReLU's backward is
    ``(1, slope)``, as ``leaky_relu_backward`` on the positive mask; dropout's is ``(scale, 0)``,
    as ``grad * noise``. Float32/64 only; None where the kernel cannot run (then the caller
    unpacks and runs torch ops)."""
    if grad.dtype not in _RELU_FLOATS:
        return None
    return _masked_pass("memsave_scale_bits", grad, packed, float(on), float(off))


def _masked_pass(name: str, grad: Tensor, packed: Tensor, *scalars: float) -> Tensor | None:
    """Run the backward kernel ``name(grad, bits, n, elem_size, *scalars, out)`` into a fresh
    gradient-shaped tensor, in chunks over threads; None where it cannot run."""
    if grad.requires_grad and torch.is_grad_enabled():
        return None  # create_graph: the result must be differentiable in grad (torch ops are)
    lib = _load()
    if lib is None or not _usable(grad) or not numpy_ok(packed) or not packed.is_contiguous():
        return None
    n = grad.numel()
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(n):
        return None
    out = torch.empty_like(grad, memory_format=torch.contiguous_format)
    size = grad.element_size()
    src, bits, dst = grad.data_ptr(), packed.data_ptr(), out.data_ptr()
    fn = getattr(lib, name)
    if n < 2 * _MIN_CHUNK or torch.get_num_threads() == 1:  # one chunk: call it directly
        fn(src, bits, n, size, *scalars, dst)
        return out
    _run([lambda s=s, c=c: fn(src + s * size, bits + s // 8, c, size, *scalars, dst + s * size) for s, c in _chunks(n)])
    return out


_OFFSET_TYPES = {torch.uint8: 1, torch.int16: 2, torch.int32: 4}


@functools.lru_cache(maxsize=64)
def _pool_tables(deltas: tuple[int, ...]) -> tuple[ctypes.Array, ctypes.Array]:
    """(delta -> window offset, -1 where no kernel position lies; offset -> delta), as C arrays."""
    table = [-1] * (max(deltas) + 1)
    for offset, delta in enumerate(deltas):
        table[delta] = offset
    return (ctypes.c_int32 * len(table))(*table), (ctypes.c_int64 * len(deltas))(*deltas)


def _geometry(out_spatial, in_spatial, stride, padding) -> list:
    n = len(stride)
    return [(ctypes.c_int64 * n)(*[int(v) for v in values]) for values in (out_spatial, in_spatial, stride, padding)]


def _planes(t: Tensor, out_spatial) -> int:
    spatial = 1
    for size in out_spatial:
        spatial *= int(size)
    return t.numel() // spatial if spatial else 0


def pool_offsets(
    flat: Tensor, out_spatial, in_spatial, stride, padding, deltas: list[int] | None, dtype: torch.dtype
) -> Tensor | None:
    """A max pool's flat argmax (int64 per input plane, as stock's pooling returns it) -> its
    row-major offset inside the window, in ``dtype``, in one pass. ``deltas``: each kernel
    position's flat distance from the window's first element (``pool._kernel_deltas``).
    None where the kernel cannot run (then the caller's torch ops do it)."""
    lib = _load()
    n = len(stride)
    if (
        lib is None
        or deltas is None
        or dtype not in _OFFSET_TYPES
        or flat.dtype != torch.int64
        or not 1 <= n <= 3
        or not numpy_ok(flat)
        or not flat.is_contiguous()
    ):
        return None
    local = torch.empty(flat.shape, dtype=dtype)
    planes = _planes(flat, out_spatial)
    if planes:
        table, _ = _pool_tables(tuple(deltas))
        failed = lib.memsave_pool_offsets(
            flat.data_ptr(),
            planes,
            n,
            *_geometry(out_spatial, in_spatial, stride, padding),
            table,
            len(table),
            _OFFSET_TYPES[dtype],
            local.data_ptr(),
        )
        if failed:  # an index outside its window: leave it to the torch ops
            return None
    return local


def pool_flat(local: Tensor, out_spatial, in_spatial, stride, padding, deltas: list[int] | None) -> Tensor | None:
    """The inverse of :func:`pool_offsets`: window offsets -> flat int64 argmax, one pass."""
    lib = _load()
    n = len(stride)
    if (
        lib is None
        or deltas is None
        or local.dtype not in _OFFSET_TYPES
        or not 1 <= n <= 3
        or not numpy_ok(local)
        or not local.is_contiguous()
    ):
        return None
    flat = torch.empty(local.shape, dtype=torch.int64)
    planes = _planes(local, out_spatial)
    if planes:
        _, delta_array = _pool_tables(tuple(deltas))
        failed = lib.memsave_pool_flat(
            local.data_ptr(),
            _OFFSET_TYPES[local.dtype],
            planes,
            n,
            *_geometry(out_spatial, in_spatial, stride, padding),
            delta_array,
            len(deltas),
            flat.data_ptr(),
        )
        if failed:
            return None
    return flat
