"""Classic DDP (``DistributedDataParallel``, its C++ reducer) on a fake process group, fake tensors.

What stops stock DDP there, and the narrow changes made for fake mode only (the real gloo
ranks run DDP exactly as a training script does):

- ``init_sync``: DDP's constructor verifies parameter shapes across ranks and broadcasts rank 0's
  parameters; both read tensor data (``_verify_params_across_processes`` fails on fake tensors).
  Fake mode passes ``init_sync=False``; neither touches the step's memory (they run once, at
  construction, in place).
- **The reduction's future**: the reducer's built-in all-reduce takes the value of the work's
  future as the reduced bucket; the fake backend completes its futures with ``None``, so the
  reducer's assertion fails in the first backward (real tensors too). Fake mode registers a comm
  hook doing what the built-in one does (average the bucket in place, all-reduce it) and returning
  a future holding the bucket. Both run in place: no storage is allocated either way.
- **The bucket rebuild** (first forward after a backward): the reducer syncs the new bucket order
  through int32 tensors it fills with accessors; in fake mode those few ops run on real tensors
  (``_RealIndexTensors``), the new buckets stay fake.

The reducer's gradient buckets are allocated by its C++ code through the dispatcher, so under
``FakeTensorMode`` they are fake tensors of the real sizes. ``wrap_ddp`` records the storages DDP's
constructor leaves alive (the buckets, and the reducer's small per-parameter "used" maps): the step
counts them from the start, as communication buffers, or as gradients where ``param.grad`` is a view
of a bucket (``gradient_as_bucket_view=True``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..parallel_spec import ParallelSpec

# The storages a DDP constructor left alive, by wrapper (weakly: a bucket rebuild frees them).
_BORN: "weakref.WeakKeyDictionary[nn.Module, list[weakref.ref]]" = weakref.WeakKeyDictionary()


class _Births(TorchDispatchMode):
    """Weak references to every storage an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                ref = self.refs.get(id(st))
                if ref is None or ref() is not st:  # an id is reused once its storage has died
                    self.refs[id(st)] = weakref.ref(st)
        return out


class _RealIndexTensors(TorchDispatchMode):
    """Under ``FakeTensorMode``: ops on no fake tensor run for real (the reducer's bucket indices).

    The reducer syncs its rebuilt bucket order across ranks through small int32 tensors it writes
    with accessors, which need data; the buckets themselves (from fake parameters) stay fake.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if (not tensors and kwargs.get("dtype") == torch.int32) or (
            tensors and not any(isinstance(t, FakeTensor) for t in tensors)
        ):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _ObservedReducer:
    """Stands in for ``ddp.reducer`` on the Python side (DDP's Python code only calls its methods):
    a bucket rebuild records the new buckets' storages, and in fake mode runs its index sync on
    real int32 tensors (``_RealIndexTensors``). Everything else goes to the C++ reducer."""

    def __init__(self, reducer: Any, ddp: nn.Module, fake: bool):
        object.__setattr__(self, "_reducer", reducer)
        object.__setattr__(self, "_ddp", weakref.ref(ddp))
        object.__setattr__(self, "_fake", fake)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        births = _Births()
        with births:
            if self._fake:
                with _RealIndexTensors():
                    done = self._reducer._rebuild_buckets()
            else:
                done = self._reducer._rebuild_buckets()
        ddp = self._ddp()
        if done and ddp is not None:
            _BORN[ddp] = [r for r in births.refs.values() if r() is not None]
        return done


def rebuild_buckets(module: nn.Module) -> bool:
    """Rebuild a DDP wrapper's buckets in gradient-ready order now, as its next forward would.

    After its first backward DDP re-buckets once, at the start of the next forward; the steady
    state is measured after that.
    """
    reducer = getattr(module, "reducer", None)
    if not isinstance(reducer, _ObservedReducer):
        return False
    return reducer._rebuild_buckets()


def _fake_pg_allreduce_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """The reducer's built-in averaging all-reduce, with a future that holds the bucket."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state))
    dist.all_reduce(buf, group=state, async_op=True)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def wrap_ddp(model: nn.Module, spec: ParallelSpec, *, fake: bool = False) -> nn.Module:
    """``DistributedDataParallel(model, ...)`` on the default group; ``fake``: the fake-backend changes."""
    from torch.nn.parallel import DistributedDataParallel

    births = _Births()
    kw: dict[str, Any] = {"bucket_cap_mb": spec.bucket_cap_mb, "gradient_as_bucket_view": spec.gradient_as_bucket_view}
    if fake:
        kw["init_sync"] = False
    with births:
        ddp = DistributedDataParallel(model, **kw)
    if fake:
        ddp.register_comm_hook(None, _fake_pg_allreduce_hook)
    _BORN[ddp] = [r for r in births.refs.values() if r() is not None]
    ddp.reducer = _ObservedReducer(ddp.reducer, ddp, fake)  # after the hook: that call needs the C++ object
    return ddp


def reducer_storages(module: nn.Module) -> list[torch.UntypedStorage]:
    """The storages ``wrap_ddp``'s constructor call left that are still alive (buckets, used maps)."""
    return [st for st in (r() for r in _BORN.get(module, ())) if st is not None]
