"""The engine's tracker taught to see FSDP2: DTensor shards, storage resizes, collective buffers.

``ShardTracker`` extends ``measure.tracker.MemoryTracker`` from outside (the engine is untouched):

- **DTensor**: the dispatch watcher returns ``NotImplemented`` for an op on DTensors, so DTensor
  runs and desugars it into ops on local shards, which the watcher then sees. Sharding
  propagation runs ops under a fake mode of DTensor's own; those are skipped by comparing the
  active fake mode with the one current when the tracker was entered.
- **Resizes**: FSDP2 frees gathered parameters by ``untyped_storage().resize_(0)`` and
  re-allocates them with ``resize_(n)``, no op output in sight: ``UntypedStorage.resize_`` is
  wrapped while the tracker is active, and a resize of a known storage is an event.
- **Communication buffers**: storages born inside FSDP2's ``foreach_all_gather`` /
  ``foreach_reduce`` (all-gather input/output, reduce-scatter input/output) are marked; those that
  become gathered parameters or gradient shards are re-categorised after the step.
- **Streams**: a storage born while FSDP2 has another stream selected (its all-gather copy-in and
  reduce-scatter streams; on the CPU ``torch.cpu``'s stand-in streams, which FSDP2 creates and
  enters just as on CUDA) is noted with that stream's number (``record_stream``; 0, the default,
  is not noted), so the allocator replay can keep per-stream pools (``replay.py``).
- **Sharding propagation on a cold cache**: the first time DTensor meets an op signature it runs the
  op on fake global-shape tensors to learn the output's metadata, under the fake mode then active,
  which in fake mode is ours. Those ops are not the rank's computation (later measurements in the
  same process hit DTensor's cache and never run them): they are ignored while they run.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from ..measure.tracker import MemoryTracker, _DispatchWatcher, _rng_states_seen
from .works import WorkReleases, released_works

_FSDP_COLLECTIVES = ("foreach_all_gather", "foreach_reduce")
# c10d's ops (FSDP2's all-gather and reduce-scatter, DDP's and HSDP's all-reduce) and the functional
# collectives (DTensor's redistributions under tensor parallel)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _group_size(args) -> int:
    """The size of the process group a collective's arguments name (a ProcessGroup or a group name)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d's ops take the group boxed
            try:
                from torch.distributed import ProcessGroup

                return int(ProcessGroup.unbox(a).size())
            except Exception:  # noqa: BLE001 - another boxed object
                continue
        size = getattr(a, "size", None)
        if size is not None and not isinstance(a, torch.Tensor) and callable(size):
            try:
                return int(size())
            except Exception:  # noqa: BLE001 - not a group after all
                continue
        if isinstance(a, str):
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group

                return int(_resolve_process_group(a).size())  # type: ignore[arg-type]  # GroupName: a NewType of str
            except Exception:  # noqa: BLE001 - a reduce op's name, not a group
                continue
    return 1


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor as it is. ``_local_tensor`` is the storage
    ``to_local()`` views, without the autograd op that makes the view (on a 70B-shaped rank those
    ops were 5% of the sizing)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return None
    return DTensor


def _async_collective_type():
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:  # pragma: no cover
        return None
    return AsyncCollectiveTensor


def _active_fake_mode():
    """The fake mode now in force (one C call per op; ``torch._guards.active_fake_mode`` walks the
    whole mode stack in Python)."""
    return _get_dispatch_mode(_FAKE_KEY) if _FAKE_KEY is not None else _guards_active_fake_mode()


def _guards_active_fake_mode():
    from torch._guards import active_fake_mode

    return active_fake_mode()


_get_dispatch_mode = getattr(torch._C, "_get_dispatch_mode", None)
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None) if _get_dispatch_mode else None


_PRIM_DEVICE = torch.ops.prim.device.default


class _ShardWatcher(_DispatchWatcher):
    def __init__(self, tracker: "ShardTracker"):
        super().__init__(tracker)
        self.dtensor = _dtensor_type()
        self.async_collective = _async_collective_type()
        self.entry_fake_mode = _active_fake_mode()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dt = self.dtensor
        if func is _PRIM_DEVICE and dt not in types:  # the autograd engine's device queries: half the ops, no storage
            return func(*args)
        if dt is not None and any(issubclass(t, dt) for t in types):
            return NotImplemented  # let DTensor desugar into local-shard ops, seen next
        releases = self.tracker.releases
        if releases is not None and func in releases.functional:
            out = releases.call_functional(func, args, kwargs)  # its Work released where the rank waits on it
        else:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if releases is not None and func is releases.wait_op and args:
                releases.waited(args[0])
        if (
            not self.tracker._in_propagation and _active_fake_mode() is self.entry_fake_mode
        ):  # not DTensor's sharding propagation
            act = self.async_collective
            if act is not None and (act in types or type(out) is act):
                self.tracker._observe(func, *_collective_results_unwrapped(act, args, kwargs, out))
            else:
                self.tracker._observe(func, args, kwargs, out)
        return out


def _collective_results_unwrapped(act: type, args, kwargs, out) -> tuple:
    """Each ``AsyncCollectiveTensor`` replaced by the tensor it wraps.

    On real tensors a functional collective's result comes back through
    ``_c10d_functional._wrap_tensor_autograd`` as an ``AsyncCollectiveTensor``: a wrapper subclass
    whose own storage holds no data (``data_ptr()`` 0), its bytes being the wrapped tensor's, which
    the collective made (and the tracker counted) already. Counting the wrapper (and each view of
    it) would count the collective's output two or three times; fake mode makes no wrapper."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(act, lambda t: t.elem, (args, kwargs, out))


class ShardTracker(MemoryTracker):
    """``MemoryTracker`` plus DTensor shards, storage resizes and FSDP2 collective buffers."""

    def __init__(self, model=None, *, count_flops: bool = False):
        super().__init__(model, count_flops=count_flops)
        self.comm_records: set[int] = set()
        # storages born inside a DTensor redistribution (TP's all-reduces, all-gathers, reduce-scatters
        # of activations and their gradients): communication unless kept for backward
        self.redistribute_records: set[int] = set()
        self._in_collective = 0
        self._in_redistribute = 0
        self._in_propagation = 0
        self._stack = contextlib.ExitStack()
        # (op, group size) -> (calls, payload bytes) of the collectives the tracked step ran
        self.collectives: dict[tuple[str, int], tuple[int, int]] = {}
        # on real ranks: each collective's Work released where the rank lets it go (parallel/works.py)
        self.releases: WorkReleases | None = None
        # record index -> the stream (1, 2, ... in order of first use) it was allocated on, if not the default
        self.record_stream: dict[int, int] = {}
        self._streams: dict[int, int] = {}
        self._default_stream: Any = None

    # -- collectives (what the layout planner times) ---------------------------------------------
    def _observe(self, func, args, kwargs, out) -> None:
        super()._observe(func, args, kwargs, out)
        if not self.ignore and getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES:
            self._note_collective(func, args, kwargs, out)

    def _note_collective(self, func, args, kwargs, out) -> None:
        """One collective call: its payload (an all-gather's output, a reduce-scatter's input, an
        all-reduce's tensors: the larger of its largest argument and all it returns) and its group's size."""
        from torch.utils._pytree import tree_flatten

        def sizes(tree) -> list[int]:
            return [t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]

        payload = max(max(sizes((args, kwargs or {})), default=0), sum(sizes(out)))
        size = _group_size([*args, *(kwargs or {}).values()])
        key = (str(func.overloadpacket), size)
        calls, total = self.collectives.get(key, (0, 0))
        self.collectives[key] = (calls + 1, total + payload)

    # -- storages -------------------------------------------------------------------------------
    def _add(self, storage, record) -> None:
        super()._add(storage, record)
        stream = torch.cpu.current_stream()
        if self._default_stream is not None and stream is not self._default_stream:
            number = self._streams.setdefault(id(stream), len(self._streams) + 1)
            self.record_stream[len(self.records) - 1] = number
        if record.kind is None:
            if self._in_collective:
                self.comm_records.add(len(self.records) - 1)
            elif self._in_redistribute:
                self.redistribute_records.add(len(self.records) - 1)

    def register_tensors(self, tensors, kind: str) -> None:
        """Like ``register_existing`` but DTensors register their local shard."""
        self.register_existing((local_shard(t) for t in tensors), kind)

    def register_storages(self, storages, kind: str) -> None:
        """Count storages that live before the step and have no tensor at hand (DDP's buckets)."""
        from ..measure.tracker import StorageRecord

        for st in storages:
            if id(st) not in self._index:
                self._add(st, StorageRecord(st.nbytes(), "", "", "setup", len(self.events), kind=kind))

    def _resized(self, storage: torch.UntypedStorage) -> None:
        idx = self._index.get(id(storage))
        nbytes = storage.nbytes()
        if idx is None:
            from ..measure.tracker import StorageRecord

            self._add(storage, StorageRecord(nbytes, self.current_module(), "resize_", self.phase, len(self.events)))
            return
        rec = self.records[idx]
        if nbytes != rec.nbytes and rec.died is None:
            self._event(idx, nbytes - rec.nbytes)
            rec.nbytes = nbytes

    # -- context --------------------------------------------------------------------------------
    def __enter__(self) -> "ShardTracker":
        stack = self._stack
        self._default_stream = torch.cpu.current_stream()
        stack.enter_context(_patched_resize(self))
        stack.enter_context(_marked_collectives(self))
        stack.enter_context(_marked_redistributions(self))
        stack.enter_context(_ignored_propagation(self))
        stack.enter_context(_rng_states_seen(self))
        if _active_fake_mode() is None:  # real tensors: a backend thread may hold a Work past its wait
            self.releases = WorkReleases()
            stack.enter_context(released_works(self.releases))
        try:
            self._install_module_hooks()
            self._mode = _ShardWatcher(self)
            self._mode.__enter__()
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._stack.close()


@contextlib.contextmanager
def _patched_resize(tracker: ShardTracker) -> Iterator[None]:
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage, size):
        out = original(storage, size)
        tracker._resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]  # wraps the stub's own
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def _counted(tracker: ShardTracker, depth: str, fn):
    """``fn`` with the tracker's ``depth`` counter raised while it runs (what it allocates is marked)."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        setattr(tracker, depth, getattr(tracker, depth) + 1)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(tracker, depth, getattr(tracker, depth) - 1)

    return inner


@contextlib.contextmanager
def _marked_collectives(tracker: ShardTracker) -> Iterator[None]:
    """Mark what FSDP2's grouped all-gather and reduce-scatter allocate as communication buffers.

    FSDP2's parameter group calls these two functions by their names in its own module; they are
    wrapped there for the step and put back after. A torch without them: nothing is marked (the
    buffers then count as temporaries), nothing fails.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg_mod
    except ImportError:  # pragma: no cover
        yield
        return
    originals = {n: getattr(pg_mod, n) for n in _FSDP_COLLECTIVES if hasattr(pg_mod, n)}
    for n, fn in originals.items():
        setattr(pg_mod, n, _counted(tracker, "_in_collective", fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(pg_mod, n, fn)


# DTensor's redistribution of a local tensor, as the modules that call it hold it (imported by name)
_REDISTRIBUTE_HOLDERS = (
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._api",
)


@contextlib.contextmanager
def _marked_redistributions(tracker: ShardTracker) -> Iterator[None]:
    """Mark what DTensor's ``redistribute_local_tensor`` allocates (the functional collectives' outputs
    and the copies that lay a sharded dim out for them) as TP's communication buffers.

    Every redistribution goes through that one function: ``DTensor.redistribute`` and its backward,
    an op whose inputs need another placement (``_dispatch``), ``from_local``'s backward (``_api``).
    A torch without it: nothing is marked (the buffers count as temporaries), nothing fails.
    """
    import importlib

    patched: list[tuple[Any, Any]] = []  # (module found by name, its function): both looked up at run time
    for name in _REDISTRIBUTE_HOLDERS:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # pragma: no cover
            continue
        fn = getattr(mod, "redistribute_local_tensor", None)
        if fn is not None:
            patched.append((mod, fn))

    for mod, fn in patched:
        mod.redistribute_local_tensor = _counted(tracker, "_in_redistribute", fn)
    try:
        yield
    finally:
        for mod, fn in patched:
            mod.redistribute_local_tensor = fn


@contextlib.contextmanager
def _ignored_propagation(tracker: ShardTracker) -> Iterator[None]:
    """Ignore the ops DTensor's sharding propagation runs on a cache miss (fake global-shape tensors,
    only to learn output metadata). A torch without that method: nothing is ignored, nothing fails."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover
        yield
        return
    original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if original is None:  # pragma: no cover
        yield
        return

    @functools.wraps(original)
    def propagate(self, *args, **kwargs):
        tracker._in_propagation += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker._in_propagation -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]
