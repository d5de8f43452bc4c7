"""Steady state in one tracked step: the optimizer makes its state on zero gradients
(``measure/optimizer_state.py``) instead of in a whole first step. The result must equal the
old two-step path's (``first_step_peak=True``) byte for byte, for every optimizer the knobs offer,
with accumulation and ``set_to_none=False``, in real and fake mode; an optimizer or a model it
cannot be trusted with falls back to the whole first step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import Workload, measure
from memsave_nb.errors import PlanError
from memsave_nb.knobs import OPTIMIZERS, optimizer_factory
from memsave_nb.model_state import ModelSnapshot

from .cases import CASES
from .oracles import memtracker_count

CASE = {c.name: c for c in CASES}


def _numbers(m):
    return (
        m.peak_bytes,
        m.peak_split,
        m.saved_bytes,
        m.output_bytes,
        m.end_of_forward,
        m.timeline.total(),
        tuple((r.name, r.saved_bytes, r.output_bytes) for r in m.modules),
    )


def _forwards(model: nn.Module) -> list[int]:
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_step_equals_two_steps(optimizer, mode):
    try:
        factory = optimizer_factory(optimizer)
    except PlanError as exc:  # an optimizer that does not build here
        pytest.skip(str(exc))
    wl = CASE["zoo_mlp"].build().replace(optimizer=factory, accumulation_steps=2, set_to_none=False)
    calls = _forwards(wl.model)
    before = ModelSnapshot.capture(wl.model)
    try:
        fast = measure(wl, mode, repeats=0)
    except Exception as exc:  # noqa: BLE001 - an optimizer this torch cannot run here (fused on CPU)
        pytest.skip(f"{optimizer}: {exc}")
    one_step = len(calls)
    assert before.differences(wl.model) == []
    slow = measure(wl, mode, repeats=0, first_step_peak=True)
    assert before.differences(wl.model) == []
    assert _numbers(fast) == _numbers(slow)
    assert slow.first_step_peak_bytes is not None
    # torch's own optimizers and bitsandbytes' layouts (optimizers_extra): state without a first step
    assert one_step == 2 and fast.first_step_peak_bytes is None
    assert len(calls) - one_step == 4  # the old path: a whole first step, then the tracked one


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_trainable_parameter_without_gradient_falls_back(mode):
    # the head's bias requires grad but the loss never reaches it: a first step gives it no state
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.unused = nn.Linear(8, 8)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    wl = Workload(Partly(), torch.randn(4, 8), optimizer="adamw", name="partly")
    fast = measure(wl, mode, repeats=0)
    slow = measure(wl, mode, repeats=0, first_step_peak=True)
    assert _numbers(fast) == _numbers(slow)
    assert fast.peak_bytes == memtracker_count(wl, iterations=2).peak_bytes


def test_an_unknown_optimizer_gets_a_whole_first_step():
    class Mine(torch.optim.SGD):
        pass

    wl = CASE["linear_relu"].build().replace(optimizer=lambda ps: Mine(ps, lr=0.1, momentum=0.9))
    calls = _forwards(wl.model)
    m = measure(wl, repeats=0)
    assert len(calls) == 2 and m.first_step_peak_bytes is not None
    assert m.peak_bytes == memtracker_count(wl, iterations=2).peak_bytes


def test_bad_first_step_peak_flag():
    from memsave_nb.errors import WorkloadError

    with pytest.raises(WorkloadError, match="first_step_peak"):
        measure(CASE["linear_relu"].build(), repeats=0, first_step_peak="yes")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_no_optimizer_one_step_equals_two_steps(set_to_none):
    wl = CASE["zoo_mlp"].build().replace(optimizer=None, set_to_none=set_to_none)
    fast = measure(wl, repeats=0)
    assert _numbers(fast) == _numbers(measure(wl, repeats=0, first_step_peak=True))
    assert fast.peak_bytes == memtracker_count(wl, iterations=2).peak_bytes


def test_step_hooks_see_only_real_gradients():
    # the state-making step on zero gradients is not a training step: hooks (a logger, clipping,
    # a test's gradient capture) see only the tracked step's gradients
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    wl = CASE["linear_relu"].build().replace(optimizer="sgd_momentum")
    seen: list[bool] = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, *_: seen.append(all(bool(p.grad.abs().sum() > 0) for g in opt.param_groups for p in g["params"]))
    )
    try:
        measure(wl, repeats=0)
    finally:
        handle.remove()
    assert seen == [True]


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("inner", ["adamw", "sgd_momentum"])
def test_fp32_master_weights_make_their_state_without_a_first_step(inner, mode):
    # the knobs' bf16 + fp32 master weights over an optimizer the engine trusts: its step on zero
    # gradients makes the masters' inner state as a first step would (the planner's bf16_master
    # probes paid a whole first step each)
    from memsave_nb.plan import Plan

    wl = CASE["zoo_mlp"].build().replace(accumulation_steps=2, set_to_none=False)
    with Plan(precision="bf16_master", optimizer=inner).apply(wl) as applied:
        calls = _forwards(applied.model)
        fast = measure(applied, mode, repeats=0)
        one_step = len(calls)
        slow = measure(applied, mode, repeats=0, first_step_peak=True)
    assert _numbers(fast) == _numbers(slow)
    assert one_step == 2 and fast.first_step_peak_bytes is None
    assert len(calls) - one_step == 4


def test_fp32_master_weights_over_an_unknown_optimizer_get_a_whole_first_step():
    from memsave_nb.knobs import MasterWeightsOptimizer

    class Mine(torch.optim.SGD):
        pass

    wl = CASE["linear_relu"].build()
    wl = wl.replace(optimizer=lambda ps: MasterWeightsOptimizer(ps, lambda ms: Mine(ms, lr=0.1, momentum=0.9)))
    calls = _forwards(wl.model)
    m = measure(wl, repeats=0)
    assert len(calls) == 2 and m.first_step_peak_bytes is not None
