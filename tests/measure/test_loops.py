"""The training loop as a named choice of the workload (``Workload.loop``): how long the model's
output lives. For each loop shape on Hugging Face models from small configs, the engine's peak
equals MemTracker on the same loop, to the byte, and equals MemTracker on the loop ``Plan.to_code``
writes for it (the exported step is the measured step)."""

from __future__ import annotations

import pytest

from memsave_nb import Plan, measure
from memsave_nb.errors import WorkloadError
from memsave_nb.workload import DEFAULT_LOOP, LOOPS

from .hf_models import MODELS
from .oracles import frozen_aware_memtracker, memtracker_count, memtracker_on_snippet

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

NAMES = ["gpt2", "llama", "t5", "lora-llama", "qwen2"]


def _tracker(name: str):
    return frozen_aware_memtracker() if name.startswith("lora") else None


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("name", NAMES)
def test_each_loop_equals_memtracker_on_that_loop(name, loop, mode):
    wl = MODELS[name]().replace(loop=loop)
    m = measure(wl, mode, repeats=0)
    assert m.peak_bytes == memtracker_count(wl, iterations=2, tracker_cls=_tracker(name)).peak_bytes
    if mode == "real":
        assert m.peak_bytes == memtracker_on_snippet(wl, Plan(), tracker_cls=_tracker(name))


def test_the_default_is_the_trainers_loop_and_dropping_the_output_lowers_the_peak():
    wl = MODELS["qwen2"]()
    assert wl.loop == DEFAULT_LOOP == "loss_only"
    peaks = {loop: measure(wl.replace(loop=loop), "fake", repeats=0).peak_bytes for loop in LOOPS}
    assert peaks["loss_only"] < peaks["keep_output_backward"] <= peaks["keep_output_step"]


PLANS = {
    "bf16_master": Plan(precision="bf16_master"),
    "autocast-sgd": Plan(precision="autocast_bf16", optimizer="sgd"),
    "regions": Plan(regions={"model.layers.0": "full", "model.layers.1": "save_matmuls"}),
}


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
@pytest.mark.parametrize("loop", list(LOOPS))
def test_exported_step_with_knobs_is_the_measured_step(plan, loop):
    """bf16_master's snippet clears the fp32 master gradients after the step, as the engine does."""
    wl = MODELS["qwen2"]().replace(loop=loop)
    with plan.apply(wl) as applied:
        m = measure(applied, "real", repeats=0)
    assert m.peak_bytes == memtracker_on_snippet(wl, plan)


def test_an_unknown_loop_is_one_line():
    with pytest.raises(WorkloadError, match="unknown loop 'keep'; choose from loss_only, keep_output_backward"):
        MODELS["gpt2"]().replace(loop="keep")


def test_advice_to_keep_only_the_loss_is_given_only_where_the_loop_keeps_the_output():
    wl = MODELS["gpt2"]()
    kept = measure(wl.replace(loop="keep_output_step"), "fake", repeats=0)
    dropped = measure(wl, "fake", repeats=0)
    assert any("logits stay alive" in a for a in kept.advice)
    assert not any("logits" in a for a in dropped.advice)
    assert any("use_cache=False" in a for a in dropped.advice)  # the cache is alive at the end of forward in every loop
