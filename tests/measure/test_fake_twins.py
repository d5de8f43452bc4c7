"""Fake runs of one model reuse its fake parameters (built once, not per run) and still follow
every change a plan makes to the real ones: a cast, a freeze, a swapped parameter."""

from __future__ import annotations

import torch

from memsave_nb import Plan, measure, zoo
from memsave_nb.measure.fake_model import _fake_model


def _twins(model):
    with _fake_model(model) as _mode:
        return {n: p for n, p in model.named_parameters()}


def test_twins_are_reused_between_runs_and_rebuilt_when_the_real_tensor_changes():
    wl = zoo.make("mlp", 4)
    first, second = _twins(wl.model), _twins(wl.model)
    name = next(iter(first))
    # new Parameter objects each run (no grad or flag outlives a run), on the same fake storage
    assert first[name] is not second[name]
    assert first[name].untyped_storage()._cdata == second[name].untyped_storage()._cdata
    real = dict(wl.model.named_parameters())[name]
    with torch.no_grad():
        real.data = real.data.to(torch.float64)
    third = _twins(wl.model)
    assert third[name].dtype == torch.float64
    assert all(p.device.type == "cpu" for p in wl.model.parameters())  # the real ones are back


def test_fake_runs_after_other_plans_equal_a_fresh_model():
    plans = [Plan(), Plan(precision="bf16"), Plan(frozen=("*",), trainable=("head.*",)), Plan()]
    used = zoo.make("gpt", 2)
    for plan in plans:
        with plan.apply(used) as w:
            again = measure(w, mode="fake", repeats=0)
        with plan.apply(zoo.make("gpt", 2)) as w:
            fresh = measure(w, mode="fake", repeats=0)
        assert (again.peak_bytes, again.peak_split, again.saved_bytes) == (
            fresh.peak_bytes,
            fresh.peak_split,
            fresh.saved_bytes,
        ), plan.describe()


def test_the_kept_fake_mode_forgets_dead_tensors_between_runs():
    """One FakeTensorMode serves a model's whole session; what its converter remembers of each
    run's constants (the optimizer's step counters) must not pile up run after run (it grew by 8
    entries per MLP run, and Session.clear could not give that back)."""
    import gc

    from memsave_nb import zoo
    from memsave_nb.measure.fake_model import _TWINS
    from memsave_nb.plan import Plan
    from memsave_nb.session import Session

    wl = zoo.make("mlp")
    session = Session(wl, mode="fake", repeats=0)

    def remembered() -> int:
        session.run(Plan())
        gc.collect()
        return len(_TWINS[wl.model].mode.fake_tensor_converter.constant_storage_mapping)

    first = [remembered() for _ in range(3)]
    later = [remembered() for _ in range(10)]
    assert max(later) <= max(first), (first, later)
    gc_objects = len(gc.get_objects())
    for _ in range(20):
        session.run(Plan())
    session.clear()
    gc.collect()
    assert len(gc.get_objects()) - gc_objects < 200  # the twenty runs left (almost) nothing behind


def test_wrappers_made_inside_the_mode_equal_those_made_outside():
    """The twins' Parameter wrappers are made inside the fake mode (one entry, not one per tensor):
    the same flags, types and devices, and the same measurement, as wrappers made outside it."""
    from torch import nn

    from memsave_nb.measure import fake_model

    wl = zoo.make("gpt", 2)
    plan = Plan(frozen=("*",), trainable=("head.*",))

    def swapped_and_measured():
        with plan.apply(wl) as w:
            with fake_model._fake_model(w.model) as _mode:
                seen = [
                    (n, type(p), p.requires_grad, p.device, getattr(p, "_is_param", False), isinstance(p, nn.Parameter))
                    for n, p in w.model.named_parameters()
                ]
            return seen, measure(w, mode="fake", repeats=0)

    inside = swapped_and_measured()
    fake_model.WRAP_IN_MODE = False
    try:
        outside = swapped_and_measured()
    finally:
        fake_model.WRAP_IN_MODE = True
    assert inside[0] == outside[0]
    assert any(flag for _, _, flag, *_ in inside[0]) and not all(flag for _, _, flag, *_ in inside[0])
    assert inside[1] == outside[1]
