"""Sees every storage born and freed during a step, tagged with module, op and phase.

A private ``TorchDispatchMode`` looks at the outputs of every aten op; a storage it has not seen
before is a new allocation. A weak reference on the storage object tells when it is freed, so
the tracker never keeps memory alive. Storages are keyed by object identity, never by
``data_ptr()`` (it is 0 under FakeTensorMode and on meta).

Why dispatch and not ``saved_tensors_hooks``: in torch 2.13 the tensors selective checkpointing
keeps never pass through those hooks, and checkpoint installs hooks of its own. Watching live
storages counts AC, SAC, views, in-place ops and reused modules the same way.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Pre-existing storages get these kinds; the rest are decided after the step.
PARAMETER, INPUT = "parameters", "inputs"


@dataclass
class StorageRecord:
    """One storage: when it was born and died (event indices), where and by what."""

    nbytes: int
    module: str
    op: str
    phase: str
    born: int
    died: int | None = None
    kind: str | None = None  # set for pre-existing storages (parameters, inputs)


class _DispatchWatcher(TorchDispatchMode):
    """Private mode: hands every op's outputs to the tracker."""

    def __init__(self, tracker: "MemoryTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._observe(func, out)
        return out


class MemoryTracker:
    """Context manager that records storage lifetimes during a training step.

    Usage::

        tracker = MemoryTracker(model)
        tracker.register_existing(model.parameters(), "parameters")
        with tracker:
            tracker.phase = "forward"; ...
        tracker.records  # list of StorageRecord
    """

    def __init__(self, model: nn.Module | None = None):
        self.records: list[StorageRecord] = []
        self.events: list[tuple[int, int]] = []  # (record index, +bytes or -bytes)
        self.event_phase: list[str] = []
        self.phase = "setup"
        self.module_stack: list[str] = []
        self.module_calls: dict[str, int] = {}
        self.module_output_shapes: dict[str, tuple[int, ...] | None] = {}
        self.op_calls: dict[tuple[str, str], int] = {}  # (module, op) -> forward calls
        self.failed_in_module: str | None = None
        self._refs: dict[int, weakref.ref] = {}
        self._index: dict[int, int] = {}
        self._op_names: dict[Any, str] = {}
        self._model = model
        self._names: dict[int, str] = {}
        self._handles: list[Any] = []
        self._mode: _DispatchWatcher | None = None

    # -- storages ---------------------------------------------------------------------------
    def _key(self, storage: torch.UntypedStorage) -> int:
        return id(storage)

    def _add(self, storage: torch.UntypedStorage, record: StorageRecord) -> None:
        key = id(storage)
        idx = len(self.records)
        self.records.append(record)
        self._index[key] = idx
        self._event(idx, record.nbytes)

        def on_free(_ref: weakref.ref, key: int = key, idx: int = idx) -> None:
            if self._index.get(key) == idx:
                del self._index[key]
                self._refs.pop(key, None)
            rec = self.records[idx]
            if rec.died is None:
                rec.died = len(self.events)
                self._event(idx, -rec.nbytes)

        self._refs[key] = weakref.ref(storage, on_free)

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

    def _observe(self, func: Any, out: Any) -> None:
        leaves = out if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        if isinstance(leaves, torch.Tensor):
            leaves = (leaves,)
        op = self._op_names.get(func)
        if op is None:
            op = self._op_names[func] = str(func.overloadpacket)
        module = self.module_stack[-1] if self.module_stack else ""
        if self.phase == "forward":
            k = (module, op)
            self.op_calls[k] = self.op_calls.get(k, 0) + 1
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse / nested / no storage
                continue
            idx = self._index.get(id(st))
            nbytes = st.nbytes()
            if idx is None:
                self._add(st, StorageRecord(nbytes, module, op, self.phase, len(self.events)))
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
            if self.phase == "forward":
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
        self._install_module_hooks()
        self._mode = _DispatchWatcher(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def live_records(self) -> list[int]:
        return [i for i, r in enumerate(self.records) if r.died is None]


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
