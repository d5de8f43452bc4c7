"""memsave_nb: see and tune what a PyTorch training step keeps in memory.

The public surface is ``__all__`` below, about 25 names, and nothing else at the top level is
promised. Build a step (:class:`Workload`, :func:`from_pretrained`, :func:`from_trainer`), choose
what it keeps (:class:`Plan`, :mod:`presets`, :class:`RegionPolicy`, :class:`ParallelSpec`),
measure it (:func:`measure`, :func:`measure_parallel`, :class:`Session`), let the planner choose
(:func:`plan_for` under a :class:`Target`) and look (:func:`explore`, :func:`write_report`).
Everything else lives in documented submodules (docs/api.md). The explorer, the planner and the
parallel engine load lazily, so that measuring never imports the UI.
"""

from __future__ import annotations

from typing import Any

from . import kernel_guard, presets, zoo  # noqa: F401  (kernel_guard first: no hub kernel fetch from bitsandbytes)
from .checkpointing import RegionPolicy
from .errors import Cancelled, MemsaveError, PlanError, StepError, WorkloadError
from .hub import from_pretrained
from .layers import convert, revert
from .measure import Measurement, measure
from .parallel_spec import ParallelSpec
from .plan import Plan
from .session import Session
from .target import Target
from .trainers import from_trainer, to_trainer
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    # build a step
    "Workload",
    "from_pretrained",
    "from_trainer",
    "zoo",
    # choose what it keeps
    "Plan",
    "presets",
    "RegionPolicy",
    "ParallelSpec",
    "convert",
    "revert",
    "to_trainer",
    # measure it
    "measure",
    "Measurement",
    "Session",
    "measure_parallel",
    # let the planner choose
    "Target",
    "plan_for",
    # look
    "explore",
    "write_report",
    # errors
    "MemsaveError",
    "WorkloadError",
    "PlanError",
    "StepError",
    "Cancelled",
]


def __getattr__(name: str) -> Any:
    """Lazy front doors: the explorer (ipywidgets, Bokeh), the report, the planner, the parallel engine."""
    if name in ("explore", "Explorer"):  # Explorer: kept for old notebooks, not part of the surface
        from .ui import explorer

        return getattr(explorer, name)
    if name == "write_report":
        from .report import write_report

        return write_report
    if name == "plan_for":
        from .planner.search import plan_for

        return plan_for
    if name == "measure_parallel":
        from .parallel.measure import measure_parallel

        return measure_parallel
    raise AttributeError(f"module 'memsave_nb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython) -> None:  # pragma: no cover - exercised through IPython in tests
    """``%load_ext memsave_nb``: register the magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:  # pragma: no cover
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
