"""Independent ways of counting the same step: PyTorch's MemTracker and the profiler's memory timeline.

Each oracle runs the step the engine runs (fresh grads, fresh batch, optimizer made inside the
step, forward, loss, backward, optimizer step), on the same workload, and puts the model back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memsave_nb.model_state import ModelSnapshot
from memsave_nb.workload import Workload, iter_tensors

# A marker allocation of an unmistakable size shows where forward ends in the profiler's events.
_MARK_BYTES = 7_777_777


@dataclass(frozen=True)
class OracleCount:
    peak_bytes: int
    end_of_forward_bytes: int
    peak_by_category: dict[str, int]
    end_of_forward_by_category: dict[str, int]


def closure_tensors(wl: Workload) -> list[torch.Tensor]:
    """Pre-existing tensors the step uses besides parameters, buffers and batch: targets the loss
    closure holds, plain tensor attributes of modules. The tracker counts them as inputs."""
    targets = getattr(wl.loss, "targets", None)
    found = [targets] if targets is not None else []
    cells = getattr(wl.loss, "__closure__", None) or ()
    found += [c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor) and c.cell_contents is not targets]
    for module in wl.model.modules():
        found += [v for v in vars(module).values() if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    return found


def _step(wl: Workload, at_forward_end=None) -> None:
    model = wl.model
    for p in model.parameters():
        p.grad = None
    batch = wl.make_batch()
    optimizer = wl.make_optimizer()
    output = wl.forward(batch)
    loss = wl.compute_loss(output)
    if at_forward_end is not None:
        at_forward_end()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    del output, loss, optimizer, batch


def memtracker_count(wl: Workload) -> OracleCount:
    """torch.distributed._tools.mem_tracker.MemTracker (fully trainable models only)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    snapshot = ModelSnapshot.capture(wl.model)
    model = wl.model
    for p in model.parameters():
        p.grad = None
    batch = wl.make_batch()
    tracker = MemTracker()
    tracker.track_external(model, *iter_tensors(batch), *closure_tensors(wl))
    forward_end: dict[str, int] = {}
    try:
        with tracker:
            optimizer = wl.make_optimizer()
            output = wl.forward(batch)
            loss = wl.compute_loss(output)
            forward_end.update(_flat(tracker.get_tracker_snapshot("current")))
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            del output, loss, optimizer
        peak = _flat(tracker.get_tracker_snapshot("peak"))
    finally:
        del batch
        snapshot.restore(model)
    return OracleCount(peak.get("Total", 0), forward_end.get("Total", 0), peak, forward_end)


def _flat(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for k, v in per_device.items():
            key = getattr(k, "value", k)
            out[key] = out.get(key, 0) + v
    return out


def profiler_count(wl: Workload) -> OracleCount:
    """The profiler's memory timeline (allocator events), tensors only.

    Allocations with no tensor identity (kernel scratch space such as oneDNN workspaces) are
    left out: no dispatch-level tool can see them, so they are not "the same storages".
    """
    from torch.profiler import profile
    from torch.profiler._memory_profiler import Action, TensorKey

    snapshot = ModelSnapshot.capture(wl.model)

    def mark() -> None:
        marker = torch.empty(_MARK_BYTES, dtype=torch.uint8)
        del marker

    try:
        with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
            _step(wl, mark)
    finally:
        snapshot.restore(wl.model)
    memory_profile = prof._memory_profile()
    live = peak = 0
    forward_end = None
    by_category: dict[str, int] = {}
    peak_by_category: dict[str, int] = {}
    forward_end_by_category: dict[str, int] = {}
    for _t, action, (key, version), nbytes in memory_profile.timeline:
        if nbytes == _MARK_BYTES or nbytes == -_MARK_BYTES:
            if action == Action.CREATE and forward_end is None:
                forward_end, forward_end_by_category = live, dict(by_category)
            continue
        if not isinstance(key, TensorKey) or key.device.type != "cpu":
            continue
        category = memory_profile._categories.get(key, version)
        name = category.name.lower() if category is not None else "unknown"
        if action in (Action.PREEXISTING, Action.CREATE):
            live += nbytes
            by_category[name] = by_category.get(name, 0) + nbytes
        elif action == Action.DESTROY:
            live -= nbytes
            by_category[name] = by_category.get(name, 0) - nbytes
        elif action == Action.INCREMENT_VERSION:  # same bytes, maybe another category
            after = memory_profile._categories.get(key, version + 1)
            after_name = after.name.lower() if after is not None else "unknown"
            by_category[name] = by_category.get(name, 0) - nbytes
            by_category[after_name] = by_category.get(after_name, 0) + nbytes
        if live > peak:
            peak, peak_by_category = live, dict(by_category)
    assert forward_end is not None, "the forward-end marker was not seen by the profiler"
    return OracleCount(peak, forward_end, peak_by_category, forward_end_by_category)
