"""Sees every storage born and freed during a step, tagged with module, op and phase.

A private ``TorchDispatchMode`` looks at the outputs of every aten op; a storage it has not seen
before is a new allocation. A weak reference on the storage object tells when it is freed, so
the tracker never keeps memory alive. Storages are keyed by object identity, never by
``data_ptr()`` (it is 0 under FakeTensorMode and on meta).

Why dispatch and not ``saved_tensors_hooks``: in torch 2.13 the tensors selective checkpointing
keeps never pass through those hooks, and checkpoint installs hooks of its own. Watching live
storages counts AC, SAC, views, in-place ops and reused modules the same way.

What a kernel allocates below the dispatcher is invisible to any mode; for the CPU convolutions,
whose oneDNN workspaces are large, ``workspace.py`` measures it per signature and the tracker books
it as a temporary at the op (``_run_with_workspace``, ``_book_workspace``).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .workspace import run_op

# Pre-existing storages get these kinds; the rest are decided after the step.
PARAMETER, INPUT = "parameters", "inputs"
TEMPORARIES = "temporaries"
_LISTS = (list, tuple)
# The op name the CPU generator states checkpoint stashes are recorded under (not a torch op:
# ``torch.get_rng_state`` copies below the dispatcher), see ``_rng_states_seen``.
RNG_STATE_OP = "get_rng_state"
_CONV, _CONV_BACKWARD = torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default  # workspace.py
_METADATA_OPS = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})
_DEVICE = torch.ops.prim.device.default


class StorageRecord:
    """One storage: when it was born and died (event indices), where and by what.

    ``kind`` is set for storages registered before the step (parameters, inputs). ``late`` marks a
    storage first met as an op *input*, never as an output: it was made outside the tracker's view
    (a target tensor held by the loss closure, a plain tensor attribute, or a 0-dim "wrapped
    number" that C++ builds from a Python scalar below the dispatcher).
    """

    __slots__ = ("nbytes", "module", "op", "phase", "born", "died", "kind", "late")

    def __init__(
        self,
        nbytes: int,
        module: str,
        op: str,
        phase: str,
        born: int,
        died: int | None = None,
        kind: str | None = None,
        late: bool = False,
    ):
        self.nbytes = nbytes
        self.module = module
        self.op = op
        self.phase = phase
        self.born = born
        self.died = died
        self.kind = kind
        self.late = late

    def __repr__(self) -> str:
        return (
            f"StorageRecord(nbytes={self.nbytes}, module={self.module!r}, op={self.op!r}, phase={self.phase!r}, "
            f"born={self.born}, died={self.died}, kind={self.kind!r}, late={self.late})"
        )


class _DispatchWatcher(TorchDispatchMode):
    """Private mode: hands every op's inputs and outputs to the tracker (and counts FLOPs)."""

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable by default: two extra
        # Python frames per op. The tracker measures eager steps only (compiled graphs bypass
        # Python dispatch altogether, see measure/compiled.py), so it does without the wrapper.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:
            # A fake tensor's device query (autograd asks about every op's tensors): no storage, not an
            # op of the step. Answered as the fake mode below answers it, without a trip down to it.
            t = args[0]
            return t.device if type(t) is FakeTensor else func(*args)
        if func is _CONV or func is _CONV_BACKWARD:  # identity: OpOverload's hash is Python, 0.3 us an op
            out = self.tracker._run_with_workspace(func, args, kwargs)
        else:
            out = func(*args, **kwargs) if kwargs else func(*args)
        self.tracker._observe(func, args, kwargs, out)
        return out


def _flop_registry() -> dict[Any, Any]:
    """``torch.utils.flop_counter``'s formulas by overload packet, unwrapped from their pytree shim.

    The registered formulas take shapes; ``shape_wrapper`` converts tensors with ``tree_map``,
    which costs more than the formula. ``_shapes`` does the same conversion for the tuples and
    lists that aten ops take.
    """
    from torch.utils.flop_counter import flop_registry

    table: dict[Any, Any] = {}
    for packet, fn in flop_registry.items():
        raw = getattr(fn, "__wrapped__", None)
        if raw is not None and getattr(fn, "__name__", "") == getattr(raw, "__name__", None):
            table[packet] = functools.partial(_call_with_shapes, raw)
        else:
            table[packet] = fn
    return table


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if type(x) in _LISTS:
        return type(x)(_shapes(v) for v in x)
    return x


def _call_with_shapes(formula: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return formula(*_shapes(args), out_shape=_shapes(out_val), **{k: _shapes(v) for k, v in kwargs.items()})


class MemoryTracker:
    """Context manager that records storage lifetimes during a training step.

    Usage::

        tracker = MemoryTracker(model, count_flops=True)
        tracker.register_existing(model.parameters(), "parameters")
        with tracker:
            tracker.phase = "forward"; ...
        tracker.records  # list of StorageRecord
        tracker.flop_counts  # {"aten.mm": n, ...}, the same formulas as torch.utils.flop_counter

    FLOPs are counted in the same dispatch pass with ``torch.utils.flop_counter``'s formula
    registry, so a step is not walked twice by two Python modes.
    """

    def __init__(self, model: nn.Module | None = None, *, count_flops: bool = False):
        self.records: list[StorageRecord] = []
        self.events: list[tuple[int, int]] = []  # (record index, +bytes or -bytes)
        self.event_phase: list[str] = []
        self.phase = "setup"
        self.module_stack: list[str] = []
        self.module_calls: dict[str, int] = {}
        self.module_output_shapes: dict[str, tuple[int, ...] | None] = {}
        self.op_calls: dict[tuple[str, str], int] = {}  # (module, op) -> forward calls
        self.flop_counts: dict[str, int] = {}
        self.failed_in_module: str | None = None
        self.count_calls = True  # False in the earlier micro-steps of an accumulated step
        self.ignore = False  # True while the engine runs an op of its own (not the step's)
        self._refs: dict[int, weakref.ref] = {}
        self._index: dict[int, int] = {}
        self._op_names: dict[Any, str] = {}
        self._flop_fns: dict[Any, Any] | None = _flop_registry() if count_flops else None
        self._model = model
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self._mode: _DispatchWatcher | None = None
        self._closed = False
        self._rng_seen: contextlib.AbstractContextManager | None = None
        self._workspace_bytes = 0  # of the op being observed (measure/workspace.py), booked after its outputs
        self.workspace_statuses: set[str] = set()  # how the step's workspaces were had (workspace.run_op)

    # -- storages ---------------------------------------------------------------------------
    def _key(self, storage: torch.UntypedStorage) -> int:
        return id(storage)

    def _add(self, storage: torch.UntypedStorage, record: StorageRecord) -> None:
        key = id(storage)
        idx = len(self.records)
        self.records.append(record)
        self._index[key] = idx
        self.events.append((idx, record.nbytes))
        self.event_phase.append(self.phase)
        self._refs[key] = weakref.ref(storage, functools.partial(self._on_free, key, idx))

    def _on_free(self, key: int, idx: int, _ref: weakref.ref) -> None:
        if self._closed:  # the step is over: what dies later (grads at restore, fake params) is not in it
            return
        if self._index.get(key) == idx:
            del self._index[key]
            self._refs.pop(key, None)
        rec = self.records[idx]
        if rec.died is None:
            rec.died = len(self.events)
            self.events.append((idx, -rec.nbytes))
            self.event_phase.append(self.phase)

    def _event(self, idx: int, delta: int) -> None:
        self.events.append((idx, delta))
        self.event_phase.append(self.phase)

    def register_existing(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Count storages that live before the step (parameters, buffers, inputs), once each."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if id(st) in self._index:
                continue
            self._add(st, StorageRecord(st.nbytes(), "", "", "setup", len(self.events), kind=kind))

    def _observe(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        if self.ignore:
            return
        op = self._op_names.get(func)
        if op is None:
            if func in _METADATA_OPS:  # fake tensors dispatch their device queries: no storage, not an op
                return
            op = self._op_names[func] = str(func.overloadpacket)
        module = self.module_stack[-1] if self.module_stack else ""
        phase = self.phase
        index = self._index
        if phase == "forward":
            if self.count_calls:
                k = (module, op)
                self.op_calls[k] = self.op_calls.get(k, 0) + 1
            # Inputs first: a storage never seen as an output existed before the op (see
            # StorageRecord). Only in forward, where the loss and model meet outside tensors.
            for a in args:
                if type(a) in _LISTS:
                    for b in a:
                        if isinstance(b, torch.Tensor):
                            self._see_input(b, module, op)
                elif isinstance(a, torch.Tensor):
                    try:
                        if id(a.untyped_storage()) not in index:
                            self._see_input(a, module, op)
                    except (RuntimeError, NotImplementedError):
                        pass
        if type(out) is torch.Tensor or isinstance(out, torch.Tensor):
            self._see_output(out, module, op, phase)
        elif type(out) in _LISTS:
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._see_output(t, module, op, phase)
        elif out is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._see_output(t, module, op, phase)
        if self._workspace_bytes:
            self._book_workspace(module, op, phase)
        if self._flop_fns is not None:
            fn = self._flop_fns.get(func._overloadpacket)
            if fn is not None:
                n = fn(*args, **(kwargs or {}), out_val=out)
                self.flop_counts[op] = self.flop_counts.get(op, 0) + n

    def _run_with_workspace(self, func: Any, args: tuple, kwargs: dict | None) -> Any:
        """Run an op that allocates below the dispatcher (a CPU convolution); its workspace bytes
        are booked by the ``_observe`` that follows (``measure/workspace.py``)."""
        if self.ignore or self._closed:
            return func(*args, **(kwargs or {}))
        out, self._workspace_bytes, status = run_op(func, args, kwargs)
        if status is not None:
            self.workspace_statuses.add(status)
        return out

    def _book_workspace(self, module: str, op: str, phase: str) -> None:
        """A temporary born and freed at the op, after its outputs: the op's peak as the allocator's."""
        nbytes, self._workspace_bytes = self._workspace_bytes, 0
        idx = len(self.records)
        self.records.append(StorageRecord(nbytes, module, op, phase, len(self.events), kind=TEMPORARIES))
        self._event(idx, nbytes)
        self.records[idx].died = len(self.events)
        self._event(idx, -nbytes)

    def _see_input(self, t: torch.Tensor, module: str, op: str) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(st) not in self._index:
            self._add(st, StorageRecord(st.nbytes(), module, op, self.phase, len(self.events), late=True))

    def _see_output(self, t: torch.Tensor, module: str, op: str, phase: str) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested / no storage
            return
        idx = self._index.get(id(st))
        nbytes = st.nbytes()
        if idx is None:
            self._add(st, StorageRecord(nbytes, module, op, phase, len(self.events)))
        else:
            rec = self.records[idx]
            if nbytes != rec.nbytes and rec.died is None:  # resize_ / out= grew a storage
                self._event(idx, nbytes - rec.nbytes)
                rec.nbytes = nbytes

    def is_live(self, tensor: torch.Tensor) -> bool:
        return id(tensor.untyped_storage()) in self._index

    def record_of(self, tensor: torch.Tensor) -> int | None:
        """Index of the record for a tensor's storage, if the tracker knows it."""
        return self._index.get(id(tensor.untyped_storage()))

    # -- modules ----------------------------------------------------------------------------
    def _install_module_hooks(self) -> None:
        if self._model is None:
            return
        for name, mod in self._model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(mod.register_forward_hook(self._post_hook(name)))

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.module_stack.append(name)
            if self.phase == "forward" and self.count_calls:
                self.module_calls[name] = self.module_calls.get(name, 0) + 1

        return hook

    def _post_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.module_stack and self.module_stack[-1] == name:
                self.module_stack.pop()
            elif name in self.module_stack:  # a child raised and was skipped: unwind to us
                while self.module_stack and self.module_stack.pop() != name:
                    pass
            if name not in self.module_output_shapes:
                self.module_output_shapes[name] = _shape_of(output)

        return hook

    def current_module(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        self._see_rng_states()
        self._install_module_hooks()
        self._mode = _DispatchWatcher(self)
        self._mode.__enter__()
        return self

    def _see_rng_states(self) -> None:
        self._rng_seen = _rng_states_seen(self)
        self._rng_seen.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            self._closed = True
            if self._rng_seen is not None:
                self._rng_seen.__exit__(None, None, None)
                self._rng_seen = None
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def live_records(self) -> list[int]:
        return [i for i, r in enumerate(self.records) if r.died is None]


@contextlib.contextmanager
def _rng_states_seen(tracker: MemoryTracker):
    """Count the CPU generator states that ``torch.get_rng_state()`` returns while the step runs.

    Checkpointing (``preserve_rng_state=True``, the default) stashes one per region in forward and
    ``fork_rng`` takes another around each recomputation: a 5,056-byte tensor that C++ copies out
    of the generator below the dispatcher, so no Python mode sees it (the allocator does). Both
    call ``torch.get_rng_state`` by attribute, so it is wrapped for the step and put back after.
    """
    original = torch.get_rng_state

    @functools.wraps(original)
    def get_rng_state() -> torch.Tensor:
        state = original()
        if not tracker.ignore and not tracker._closed:
            tracker._see_output(state, tracker.current_module(), RNG_STATE_OP, tracker.phase)
        return state

    torch.get_rng_state = get_rng_state  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state = original  # type: ignore[assignment]


def _shape_of(output: Any) -> tuple[int, ...] | None:
    if isinstance(output, torch.Tensor):
        return tuple(output.shape)
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor):
            return tuple(t.shape)
    for name in ("logits", "last_hidden_state"):
        t = getattr(output, name, None)
        if isinstance(t, torch.Tensor):
            return tuple(t.shape)
    return None
