"""memsave_nb: see and tune what a PyTorch training step keeps in memory.

The public names, from the bottom of the flow up: :class:`Workload` (one training step),
:class:`Plan` and :mod:`presets` (memory choices, applied and undone exactly),
:func:`measure` (the engine) and :class:`Measurement`, :class:`Session` (baseline, history,
deltas), :func:`convert`/:func:`revert` (memory-saving layers), and :func:`explore` (the
notebook explorer, imported lazily so that measuring never loads the UI).
"""

from __future__ import annotations

from typing import Any

from . import presets
from .checkpointing import RegionPolicy
from .hub import from_pretrained
from .errors import Cancelled, MemsaveError, StepError, WorkloadError
from .layers import convert, revert
from .measure import Measurement, measure
from .plan import Plan
from .session import Session
from .trainers import from_trainer, to_trainer
from .workload import Workload

__version__ = "0.1.0"

__all__ = [
    "Workload",
    "from_pretrained",
    "from_trainer",
    "to_trainer",
    "Plan",
    "RegionPolicy",
    "presets",
    "measure",
    "Measurement",
    "Session",
    "convert",
    "revert",
    "explore",
    "write_report",
    "MemsaveError",
    "StepError",
    "WorkloadError",
    "Cancelled",
]


def __getattr__(name: str) -> Any:
    """Lazy front doors: the explorer (ipywidgets, Bokeh) and the HTML report."""
    if name in ("explore", "Explorer"):
        from .ui import explorer

        return getattr(explorer, name)
    if name == "write_report":
        from .report import write_report

        return write_report
    raise AttributeError(f"module 'memsave_nb' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:  # pragma: no cover - exercised through IPython in tests
    """``%load_ext memsave_nb``: register the magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:  # pragma: no cover
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
