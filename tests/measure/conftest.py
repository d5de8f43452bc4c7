"""One fixture feeds every engine test its case; measurements are cached per case and mode."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.measure import Measurement, measure, workspace

from .cases import CASE_IDS, CASES, Case

_CACHE: dict[tuple[str, str, bool, bool], Measurement] = {}


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request) -> Case:
    return request.param


@pytest.fixture(autouse=True)
def _one_thread():
    """Two shared cores: one intra-op thread keeps runs steady and results deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def without_workspaces():
    """For tests against a dispatch-level oracle (MemTracker, the profiler's tensor timeline), which
    cannot see what a kernel allocates below the dispatcher: the engine leaves the CPU
    convolutions' workspaces out too (``measure/workspace.py``; ``test_allocator_oracle.py`` holds
    them to the allocator's record)."""
    with workspace.uncounted():
        yield


def measured(case: Case, mode: str = "real", steady_state: bool = True) -> Measurement:
    """The case measured once per session (no timing repeats): tests only read it.

    ``steady_state=False``: the first training step (for oracles that count one step)."""
    key = (case.name, mode, steady_state, workspace.counting())
    if key not in _CACHE:
        _CACHE[key] = measure(case.build(), mode, repeats=0, steady_state=steady_state)
    return _CACHE[key]
