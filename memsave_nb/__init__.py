"""memsave_nb: see and tune what a PyTorch training step keeps in memory."""

from __future__ import annotations

from .errors import Cancelled, MemsaveError, StepError, WorkloadError
from .measure import Measurement, measure
from .workload import Workload

__version__ = "0.1.0"

__all__ = ["Workload", "measure", "Measurement", "MemsaveError", "StepError", "WorkloadError", "Cancelled"]


def load_ipython_extension(ipython) -> None:  # pragma: no cover - exercised through IPython in tests
    """``%load_ext memsave_nb``: register the magics."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython) -> None:  # pragma: no cover
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)
