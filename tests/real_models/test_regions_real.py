"""Full and selective checkpointing over a real model's repeated blocks: the step runs and gives the
stock gradients; Hugging Face's KV cache is turned off for the step and put back exactly."""

from __future__ import annotations

import pytest

from memsave_nb import hf
from memsave_nb.checkpointing import suggest_regions
from memsave_nb.errors import StepError
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan, PlanError
from .real_cases import case_named, shared
from .real_steps import assert_same_grads, step_grads


def _config_state(model):
    return [(id(c), dict(vars(c)).get("use_cache", "absent")) for c in hf._configs(model)]


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_regions_give_stock_gradients(case, policy):
    wl = case.workload
    blocks = suggest_regions(wl.model)
    assert len(blocks) >= 2
    plan = Plan(regions={b: policy for b in blocks})
    expected = step_grads(wl)
    configs = _config_state(wl.model)
    snapshot = ModelSnapshot.capture(wl.model)
    with plan.apply(wl) as applied:
        assert not hf.has_kv_cache(applied.model)
        got = step_grads(applied)
        checkpointed = measure(applied, "real", repeats=0, flops=False)
    assert_same_grads(got, expected)
    assert _config_state(wl.model) == configs  # use_cache back, as an instance attribute
    assert snapshot.differences(wl.model) == []
    plain = measure(wl, "real", repeats=0, flops=False)
    assert checkpointed.saved_bytes < plain.saved_bytes


def test_describe_says_the_cache_goes_off():
    gpt2 = shared(case_named("gpt2")).model
    plan = Plan(regions={"transformer.h.0": "save_matmuls"})
    assert "KV cache off (use_cache=False)" in plan.describe(gpt2)
    assert "KV cache" not in Plan(frozen="*").describe(gpt2)  # no regions: the cache stays as it is
    assert "KV cache" not in plan.describe()  # without the model it cannot know


def test_a_batch_asking_for_the_cache_is_refused_before_running():
    wl = shared(case_named("gpt2")).workload
    asks = wl.replace(batch={**wl.batch, "use_cache": True})
    snapshot = ModelSnapshot.capture(wl.model)
    plan = Plan(regions={"transformer.h.0": "save_matmuls", "transformer.h.1": "save_matmuls"})
    with pytest.raises(PlanError, match="use_cache=True.*drop use_cache from the batch"):
        with plan.apply(asks):
            raise AssertionError("the plan should not apply")
    assert snapshot.differences(wl.model) == []
    assert wl.model.config.use_cache is True
    # use_cache=False in the batch is what the plan needs anyway
    with plan.apply(wl.replace(batch={**wl.batch, "use_cache": False})) as applied:
        measure(applied, "real", repeats=0, flops=False)


def test_a_batch_factory_asking_for_the_cache_is_refused_at_the_first_forward():
    wl = shared(case_named("lora-llama")).workload
    asks = wl.replace(batch=lambda: {**wl.batch, "use_cache": True})
    plan = Plan(regions={b: "save_matmuls" for b in suggest_regions(wl.model)})
    with plan.apply(asks) as applied:
        with pytest.raises(PlanError, match="the batch passes use_cache=True"):
            measure(applied, "real", repeats=0, flops=False)
    assert hf.has_kv_cache(wl.model)
    assert not wl.model._forward_pre_hooks


def test_sac_on_gpt2_with_the_cache_on_still_fails_without_the_plan():
    """The oracle for why the plan turns the cache off: wrapping the regions by hand with the cache
    on fails in backward, as reported in issue 10."""
    from memsave_nb.checkpointing import policy_preset, wrap_region

    wl = shared(case_named("gpt2")).workload
    undo = [wrap_region(wl.model.get_submodule(b), policy_preset("save_matmuls")) for b in suggest_regions(wl.model)]
    try:
        with pytest.raises(StepError, match="not found in storage"):
            measure(wl, "real", repeats=0, flops=False)
    finally:
        for fn in reversed(undo):
            fn()
