"""One fixture feeds every engine test its case; measurements are cached per case and mode."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.measure import Measurement, measure

from .cases import CASE_IDS, CASES, Case

_CACHE: dict[tuple[str, str, bool], Measurement] = {}


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


def measured(case: Case, mode: str = "real", steady_state: bool = True) -> Measurement:
    """The case measured once per session (no timing repeats): tests only read it.

    ``steady_state=False``: the first training step (for oracles that count one step)."""
    key = (case.name, mode, steady_state)
    if key not in _CACHE:
        _CACHE[key] = measure(case.build(), mode, repeats=0, steady_state=steady_state)
    return _CACHE[key]
