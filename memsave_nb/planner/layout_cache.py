"""What one layout search measured, kept for the next search of the same model and start plan.

The GPUs tab searches again when the GPU kind, the target or the GPU count changes; the per-rank
peaks do not depend on the GPU kind or the target, and the single-device saved bytes and roofline
seconds not on the GPU count. So a search reuses every key an earlier search of the same step
measured (``layout_measure.Measured``), and the chosen layout's full-depth re-measurement when it is
chosen again. "The same step" is checked, never assumed: the model's parameters and buffers
(name, shape, dtype, device, requires_grad), its modules' classes, modes, hooks and instance
forwards, its config (a Hugging Face config's fields, else its repr), the workload's other fields (by identity, or equal
plain values), the start plan (as JSON) and the block list. Anything else changed: a new store.
Kept per model object (weakly: a model that goes away takes its stores with it), the last few."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, Any

from memsave_nb.planner.depth import Blocks
from memsave_nb.planner.layout_measure import Measured
from memsave_nb.planner.start_plan import StartPlan

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.workload import Workload

__all__ = ["store_for", "clear"]

KEEP = 4  # stores per model (start plans, batches) kept
_STORES: "weakref.WeakKeyDictionary[Any, list[tuple[tuple, tuple, Measured]]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_PLAIN = (int, float, str, bool, bytes, type(None))


def _model_key(model) -> tuple:
    params = tuple(
        (n, tuple(p.shape), p.dtype, str(p.device), p.requires_grad, type(p).__name__)
        for n, p in model.named_parameters(remove_duplicate=False)
    )
    buffers = tuple((n, tuple(b.shape), b.dtype, str(b.device)) for n, b in model.named_buffers(remove_duplicate=False))
    modules = tuple(
        (
            n,
            type(m),
            m.training,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            len(getattr(m, "_backward_pre_hooks", ())),
            "forward" in m.__dict__,
        )
        for n, m in model.named_modules(remove_duplicate=False)
    )
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return params, buffers, modules, to_json() if callable(to_json) else repr(config)


def _field_values(workload: "Workload") -> tuple:
    return tuple(getattr(workload, f.name) for f in dataclasses.fields(workload) if f.name != "model")


def _same_fields(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        x is y or (isinstance(x, _PLAIN) and type(x) is type(y) and x == y) for x, y in zip(a, b)
    )


def store_for(workload: "Workload", start: StartPlan, blocks: Blocks) -> Measured:
    """The store an earlier search of the same step filled, or a new one kept for the next search."""
    model = workload.model
    key = (_model_key(model), start.plan.to_json(), blocks)
    fields = _field_values(workload)
    with _LOCK:
        try:
            kept = _STORES.setdefault(model, [])
        except TypeError:  # a model that takes no weak reference: nothing kept
            return Measured()
        for i, (k, f, store) in enumerate(kept):
            if k == key and _same_fields(f, fields):
                kept.append(kept.pop(i))  # most recently used last
                return store
        store = Measured()
        kept.append((key, fields, store))
        del kept[:-KEEP]
        return store


def clear() -> None:
    """Forget every kept measurement (tests, benchmarks)."""
    with _LOCK:
        _STORES.clear()
