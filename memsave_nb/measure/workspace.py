"""Kernel workspaces: memory a CPU convolution allocates below the dispatcher, measured per signature.

On the CPU, ``aten.convolution`` and ``aten.convolution_backward`` run oneDNN (or, for float64 and
other dtypes it does not take, ATen's im2col kernels). Inside the op they allocate through
PyTorch's CPU allocator what no dispatch mode sees: ``contiguous()`` copies of their operands,
reorders of input, weight and grad_output into oneDNN's blocked layouts, the output in blocked
layout before it is copied out to the dense tensor, gradients in blocked layout, and the
primitive's scratchpad. Measured on torch 2.13 (AVX-512, 2 threads), every convolution does:

- ``Conv2d(16, 32, 3, stride=2, padding=1)``, batch 8 x 32^2, NCHW float32: forward 542,720 B
  above its 262,144-byte output; backward (weight and bias grads only) 1,075,456 B above its
  18,560 B of outputs: the grad_output copy and its reorder, the input's reorder, the weight
  grad in blocked layout, 26,880 B of scratchpad, the bias grad; stride 1 and 1 x 1 alike;
- channels-last convolutions take views instead of reorders (forward 30,768 B extra), depthwise
  and grouped ones other primitives, float64 the im2col columns (2,359,296 B in forward).

The sizes depend on the primitive oneDNN picks, so on the CPU (its ISA and its thread count),
the shapes, strides, dtype, groups and which gradients are asked for. No formula covers them;
the op itself is the only exact source. So the first call of each signature (op, every tensor
argument's shape, strides and dtype, the other arguments, the thread count) runs under the
autograd profiler's allocation records (the legacy one: no Kineto start-up, about half a
millisecond): the highest running sum of the op's allocations, minus what it still holds at
the end (its outputs), is the workspace. Later calls of the signature reuse the number. The
tracker books it as a temporary born and freed at the op, after its outputs: the step's peak
then rises exactly as the allocator's does while the op runs. Deterministic: the same
signature measured the same bytes on every call tried.

Fake mode (a fake CPU device) has no memory to watch: the signature is looked up, and when the
process has not run it for real, the op is run once on real zero tensors of the same shapes
out of every mode. A probe whose tensors would pass ``PROBE_BYTES`` runs at a smaller batch and
is scaled up by the batch ratio: an upper bound, never under (each phase of the op holds bytes
that grow at most in proportion with the batch), and the only case that is not exact.

Not counted: CUDA tensors (cuDNN's and cuBLAS's workspaces come from the caching allocator in
sizes that depend on the algorithm; the per-rank results name them as an unseen line), and real
steps measured while a profiler is already running (it cannot be started twice; nothing is
added then, unless the signature is already known).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

WORKSPACE_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})
# Arguments whose dimension 0 is the batch, per op: scaled together when a fake-mode probe shrinks.
_BATCHED_ARGS = {torch.ops.aten.convolution.default: (0,), torch.ops.aten.convolution_backward.default: (0, 1)}
PROBE_BYTES = 16 * 2**20  # a fake-mode probe's real inputs and outputs stay under this (smaller batch above it)
MIN_PROBE_BATCH = 16

_measured: dict[tuple, tuple[int, bool]] = {}  # signature -> (workspace bytes, scaled bound), process-wide
EXACT, BOUND, UNMEASURED = "exact", "bound", "unmeasured"
_counting = [True]


def counting() -> bool:
    """Whether kernel workspaces are counted now (see ``uncounted``)."""
    return _counting[-1]


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Leave kernel workspaces out while it is open: what a dispatch-level tracker (MemTracker,
    FSDPMemTracker) sees, for comparing with one byte for byte."""
    _counting.append(False)
    try:
        yield
    finally:
        _counting.pop()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _tensors(args: Any) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out


def _signature(func: Any, args: tuple, kwargs: dict) -> tuple:
    def key(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), tuple(a.stride()), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(key(b) for b in a)
        return a

    # the kernel ATen picks also follows the thread count and the oneDNN switches
    backend = (
        torch.get_num_threads(),
        torch._C._get_mkldnn_enabled(),
        torch._C._get_mkldnn_deterministic() if hasattr(torch._C, "_get_mkldnn_deterministic") else None,
    )
    return (func, key(args), tuple(sorted((k, key(v)) for k, v in kwargs.items())), backend)


def _allocation_peak(run: Callable[[], Any]) -> tuple[int, int] | None:
    """Run ``run`` under the autograd profiler's allocation records: (highest running sum, bytes
    still held at the end: the outputs, kept alive until the records are read). None when a
    profiler is already running or this torch has no legacy profiler."""
    enable = getattr(torch.autograd, "_enable_profiler_legacy", None)
    disable = getattr(torch.autograd, "_disable_profiler_legacy", None)
    if enable is None or disable is None or torch.autograd._profiler_enabled():
        return None
    config = torch.autograd.ProfilerConfig(
        torch.autograd.ProfilerState.CPU, False, True, False, False, False, torch._C._profiler._ExperimentalConfig()
    )
    try:
        enable(config)
    except RuntimeError:  # another thread's profiler holds it
        return None
    try:
        out = run()
    finally:
        records = disable()
    live = peak = 0
    for thread in records:
        for r in thread:
            if r.kind() == "memory_alloc":
                live += r.cpu_memory_usage()
                peak = max(peak, live)
    del out
    return peak, live


def _real_twin(t: torch.Tensor, batch: int | None) -> torch.Tensor:
    """Zeros with ``t``'s strides and dtype on the CPU (dimension 0 set to ``batch`` if given; the
    batch dimension is outermost, so the other strides stay valid)."""
    size = list(t.shape)
    if batch is not None:
        size[0] = batch
    return torch.empty_strided(size, t.stride(), dtype=t.dtype, device="cpu").zero_()


def _fake_probe(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, bool] | None:
    """The op once on real zero tensors shaped as the fake ones, out of every mode. When they would
    pass ``PROBE_BYTES`` it runs at a smaller batch m of n: every phase of the op holds bytes
    a + b x batch (a, b >= 0), so (n / m) x its peak bounds the full op's peak from above, less the
    full op's outputs (``out``, the fake run's)."""
    from torch.utils._python_dispatch import _disable_current_modes

    batched = _BATCHED_ARGS[func]
    # inputs and outputs both become real memory (a 4096-image conv's output is larger than its input)
    full = sum(
        t.untyped_storage().nbytes()
        for t in _tensors(args) + _tensors(out if isinstance(out, (list, tuple)) else (out,))
    )
    batch = args[batched[0]].shape[0] if args[batched[0]].dim() else 1
    small = batch
    if full > PROBE_BYTES and batch > MIN_PROBE_BATCH:
        # not under 16: ATen picks the kernel by batch too (oneDNN only from 2; a 1x1 from 16
        # when single-threaded), and a probe must run the kernel the step runs
        small = max(MIN_PROBE_BATCH, batch * PROBE_BYTES // full)

    def twin(i: int, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return _real_twin(a, small if (i in batched and small != batch) else None)
        return a

    with _disable_current_modes(), torch.no_grad():
        real_args = tuple(twin(i, a) for i, a in enumerate(args))
        measured = _allocation_peak(lambda: func(*real_args, **kwargs))
    if measured is None:
        return None
    peak, held = measured
    if small == batch:
        return max(0, peak - held), False
    outputs = sum(t.untyped_storage().nbytes() for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)))
    return max(0, -(-peak * batch // small) - outputs), True  # ceil(peak x n / m) less the outputs


def run_op(func: Any, args: tuple, kwargs: dict | None) -> tuple[Any, int, str | None]:
    """Run one op for the tracker: its outputs, the workspace bytes it allocated beyond them below
    the dispatcher, and how they were had (``EXACT``, ``BOUND``, ``UNMEASURED``; None for an op
    without one, CUDA tensors, or while ``uncounted``)."""
    kwargs = kwargs or {}
    if func not in WORKSPACE_OPS or not _counting[-1]:
        return func(*args, **kwargs), 0, None
    tensors = _tensors(args)
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return func(*args, **kwargs), 0, None
    sig = _signature(func, args, kwargs)
    known = _measured.get(sig)
    if known is not None:
        return func(*args, **kwargs), known[0], BOUND if known[1] else EXACT
    if any(_is_fake(t) for t in tensors):
        out = func(*args, **kwargs)
        found = _fake_probe(func, args, kwargs, out)
    else:
        box: list[Any] = []

        def call() -> Any:  # keeps the output for the caller
            box.append(func(*args, **kwargs))
            return box[0]

        measured = _allocation_peak(call)
        out = box[0] if box else func(*args, **kwargs)
        found = None if measured is None else (max(0, measured[0] - measured[1]), False)
    if found is None:
        return out, 0, UNMEASURED
    _measured[sig] = found
    return out, found[0], BOUND if found[1] else EXACT


def workspace_notes(statuses: set[str]) -> tuple[str, ...]:
    """The measurement's notes on the CPU convolutions' workspaces the step ran (``run_op``'s
    statuses): where the figure is a bound or misses some, and that a GPU's are not these."""
    if not statuses:
        return ()
    notes = [
        "CPU convolution workspaces (oneDNN's reorders and scratch) are counted as temporaries, as this "
        "CPU allocates them; a CUDA GPU runs cuDNN, whose workspaces depend on the algorithm it picks and "
        "are not counted: measure on the GPU (cuda_peak_bytes) to see them"
    ]
    if BOUND in statuses:
        notes.append(
            "some convolution workspaces were sized from a smaller batch and scaled up (fake mode, "
            "probe over 16 MiB): an upper bound, not exact"
        )
    if UNMEASURED in statuses:
        notes.append(
            "some convolution workspaces were not counted: a profiler was already running, and a "
            "second cannot start to measure them"
        )
    return tuple(notes)
