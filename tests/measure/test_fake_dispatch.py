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


# adamw_8bit / lion_8bit: bitsandbytes' layout in plain torch (optimizers_extra), so fake mode runs them too
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_knob_first_step_and_plan_equals_torchs_path(optimizer, monkeypatch):
    plan = Plan(
        optimizer=optimizer,
        precision="bf16",
        frozen=("blocks.0.*",),
        regions={"blocks.1": "save_matmuls"},
        accumulation_steps=2,
        set_to_none=False,
    )
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


def test_a_quick_hit_makes_the_tensor_torch_makes(monkeypatch):
    """Same class, metadata, flags, storage sharing (views) and attributes as torch's cache hit."""

    def outputs():
        mode = FakeTensorMode()
        with fake_dispatch.quick_dispatch(mode), mode:
            x = torch.empty(4, 6, requires_grad=True)
            y = torch.empty(4, 6, dtype=torch.complex64)
            made = []
            for _ in range(2):  # the second round hits the cache
                made = [x * 2, x.view(6, 4), x.t(), y.conj(), torch.ones(3, dtype=torch.bfloat16), x.detach().add_(1)]
            return x, made

    quick = outputs()
    monkeypatch.setattr(fake_dispatch, "ENABLED", False)
    slow = outputs()
    for q, s in zip(quick[1], slow[1]):
        assert type(q) is type(s)
        assert (
            q.shape,
            q.stride(),
            q.storage_offset(),
            q.dtype,
            q.device,
            q.requires_grad,
            q.is_conj(),
            q.is_neg(),
        ) == (s.shape, s.stride(), s.storage_offset(), s.dtype, s.device, s.requires_grad, s.is_conj(), s.is_neg())
        assert set(vars(q)) == set(vars(s))
        assert {k: v for k, v in vars(q).items() if k != "fake_mode"} == {
            k: v for k, v in vars(s).items() if k != "fake_mode"
        }
    for made, x in ((quick[1], quick[0]), (slow[1], slow[0])):
        assert made[1].untyped_storage()._cdata == x.untyped_storage()._cdata  # a view shares its base's storage
        assert made[0].untyped_storage()._cdata != x.untyped_storage()._cdata


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "lora_llama"])
def test_hugging_face_models_equal_torchs_path(name, monkeypatch):
    """transformers' mask checks (fake_compat) and peft's wrappers on the quick path too."""
    pytest.importorskip("transformers")
    if name == "lora_llama":
        pytest.importorskip("peft")
    from . import hf_models

    build = getattr(hf_models, name)
    assert measure(build(), "fake", repeats=0) == _torch_path(build, monkeypatch)
