"""Fake mode's quick dispatch (``measure/fake_dispatch.py``) changes no byte: every measurement
equals the one taken on torch's own path, and its cache key is never coarser than torch's."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState, _BypassDispatchCache

from memsave_nb import Plan, measure, zoo
from memsave_nb.knobs import OPTIMIZERS
from memsave_nb.measure import fake_dispatch
from memsave_nb.measure.fake_model import _fake_model

from .conftest import measured

pytestmark = pytest.mark.skipif(not fake_dispatch.supported(), reason="this torch's fake mode differs from 2.13's")


def _torch_path(build, monkeypatch, **kw):
    monkeypatch.setattr(fake_dispatch, "ENABLED", False)
    try:
        return measure(build(), "fake", repeats=0, **kw)
    finally:
        monkeypatch.setattr(fake_dispatch, "ENABLED", True)


def test_every_case_equals_torchs_path(case, monkeypatch):
    quick = measured(case, "fake")
    assert quick == _torch_path(case.build, monkeypatch)  # every field: peak, split, rows, ops, timeline


# adamw_8bit (bitsandbytes) reads values while it makes its state: fake mode cannot run it on either path
@pytest.mark.parametrize("optimizer", sorted(set(OPTIMIZERS) - {"adamw_8bit"}))
def test_every_optimizer_knob_first_step_and_plan_equals_torchs_path(optimizer, monkeypatch):
    plan = Plan(optimizer=optimizer, precision="bf16", frozen=("blocks.0.*",),
                regions={"blocks.1": "save_matmuls"}, accumulation_steps=2, set_to_none=False)
    for kw in ({}, {"first_step_peak": True}, {"steady_state": False}):
        with plan.apply(zoo.make("gpt", 2)) as quick_wl, plan.apply(zoo.make("gpt", 2)) as torch_wl:
            assert measure(quick_wl, "fake", repeats=0, **kw) == _torch_path(lambda: torch_wl, monkeypatch, **kw), kw


def test_the_quick_key_is_never_coarser_than_torchs(monkeypatch):
    """Two ops with one quick key have one torch key: a hit on the quick key returns what torch's
    cache would have returned."""
    pairs: dict[object, object] = {}
    original = fake_dispatch.quick_key

    def both(mode, func, args, kwargs):
        key = original(mode, func, args, kwargs)
        if key is not None:
            try:
                torch_key = FakeTensorMode._cache_key(mode, _CacheKeyState(mode.shape_env), func, args, kwargs)
            except _BypassDispatchCache as e:
                torch_key = ("bypass", e.reason)
            assert pairs.setdefault(key, torch_key) == torch_key, func
        return key

    monkeypatch.setattr(fake_dispatch, "quick_key", both)
    measure(zoo.make("gpt", 2), "fake", repeats=0)
    assert len(pairs) > 50


def test_the_mode_is_quick_only_inside_the_run_and_hits_are_counted():
    wl = zoo.make("mlp", 4)
    with _fake_model(wl.model) as mode:
        assert type(mode) is not FakeTensorMode and isinstance(mode, FakeTensorMode)
        before = FakeTensorMode.cache_hits
        with mode:
            x = torch.empty(8, 16)
            for _ in range(3):
                torch.relu(x)
        assert FakeTensorMode.cache_hits >= before + 2
    assert type(mode) is FakeTensorMode
