"""``measure()`` against the allocator's own record of the same step (``allocator_oracle.py``).

The loop is the one ``measure()`` runs today (engine ``_Step.run``), written out here: step 1 makes
the optimizer's state, gradients are set to None, then step 2 (forward, loss, backward, optimizer
step; the output lives as the workload's ``loop`` says, ``output_dropped``) is profiled. The batch of step 2 exists
before it, as in a training loop.

Allowed gap: the 0-dim "wrapped number" tensors C++ builds from Python scalars
(``WRAPPED_NUMBER_SLACK``, see ``test_oracles.py``); they never reach a dispatch mode.

Known, not yet counted (strict xfail, so a fix shows up): CPU convolutions' backward (oneDNN)
allocates workspaces below the dispatcher; no Python mode sees them (docs/parallel.md, "unseen").
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import Plan, measure, zoo
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.workload import Workload, iter_tensors, output_dropped

from . import hf_models
from .allocator_oracle import AllocatorCount, allocator_peak, allocation_events, timeline_peak
from .oracles import closure_tensors

# 0-dim "wrapped number" tensors C++ builds from Python scalars (the optimizer's, a LoRA layer's
# ``scaling``): they never reach a dispatch mode; up to four 8-byte ones alive at once here.
WRAPPED_NUMBER_SLACK = 32


def engine_loop_peak(wl: Workload) -> AllocatorCount:
    """Step 2 of the engine's loop, as the allocator saw it; the model is put back after.

    k = ``accumulation_steps`` micro-steps (forward, loss / k, backward) on the same batch, then the
    optimizer step; between steps gradients are set to None or zeroed as ``set_to_none`` says."""
    model = wl.model
    snapshot = ModelSnapshot.capture(model)
    for p in model.parameters():
        p.grad = None
    optimizer = wl.make_optimizer()
    k = wl.accumulation_steps

    def one_step(batch) -> None:
        for micro in range(k):
            output = wl.forward(batch)
            loss = wl.compute_loss(output)
            if k > 1:
                loss = loss / k
            if output_dropped(wl.loop, "backward"):
                output = None  # loss_only: only the loss goes into backward
            loss.backward()
            if micro < k - 1:
                del output, loss
        if output_dropped(wl.loop, "step"):
            output = None
        if optimizer is not None:
            optimizer.step()
        del output, loss  # the loss lives to the end of the step (a trainer logs it)

    try:
        one_step(wl.make_batch())
        for p in model.parameters():  # zero_grad between steps
            if p.grad is not None:
                if wl.set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        batch = wl.make_batch()
        state = [t for s in optimizer.state.values() for t in iter_tensors(s)] if optimizer is not None else []
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        alive = [*model.parameters(), *model.buffers(), *grads, *state, *iter_tensors(batch), *closure_tensors(wl)]
        return allocator_peak(lambda: one_step(batch), alive)
    finally:
        snapshot.restore(model)


def _strided_conv() -> Workload:
    torch.manual_seed(0)
    return Workload(nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.randn(8, 16, 32, 32), loss=lambda o: o.sum(),
                    name="strided_conv")


def _gpt_tiny() -> Workload:
    cfg = zoo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
    return zoo.gpt(cfg, batch_size=2)


def _hf_llama() -> Workload:
    pytest.importorskip("transformers")
    return hf_models.llama()


def _lora_llama() -> Workload:
    pytest.importorskip("peft")
    return hf_models.lora_llama()


CONV_WORKSPACE = pytest.mark.xfail(strict=True, reason="CPU convolution backward workspaces are allocated below the dispatcher")

CASES = [
    pytest.param(_strided_conv, None, id="strided_conv", marks=CONV_WORKSPACE),
    pytest.param(lambda: zoo.make("cnn", batch_size=2), None, id="zoo_cnn", marks=CONV_WORKSPACE),
    pytest.param(_gpt_tiny, None, id="zoo_gpt"),
    pytest.param(_gpt_tiny, Plan(regions={"blocks.0": "full", "blocks.1": "full"}), id="zoo_gpt_full_ac"),
    pytest.param(_gpt_tiny, Plan(regions={"blocks.0": "save_matmuls", "blocks.1": "save_matmuls"}), id="zoo_gpt_sac"),
    pytest.param(_gpt_tiny, Plan(accumulation_steps=2, set_to_none=False, regions={"blocks.1": "full"}),
                 id="zoo_gpt_accumulate_zeroed_grads_ac"),
    pytest.param(_hf_llama, None, id="hf_llama"),
    pytest.param(_lora_llama, None, id="lora_llama"),
]


@pytest.mark.parametrize(("build", "plan"), CASES)
def test_peak_is_the_allocators(build, plan):
    wl = build()
    if plan is None:
        tracked = measure(wl).peak_bytes
        oracle = engine_loop_peak(wl)
    else:
        with plan.apply(wl) as applied:
            tracked = measure(applied).peak_bytes
            oracle = engine_loop_peak(applied)
    gap = oracle.peak_bytes - tracked
    assert 0 <= gap <= WRAPPED_NUMBER_SLACK, f"allocator {oracle.peak_bytes:,} B, measure() {tracked:,} B ({gap:+,})"


def test_raw_events_equal_the_profilers_timeline():
    """Where the profiler's own memory timeline builds, its peak is the raw events' peak."""
    from torch.profiler import ProfilerActivity, profile

    wl = _gpt_tiny()
    batch = wl.make_batch()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        wl.compute_loss(wl.forward(batch)).backward()
    live = rise = 0
    for _t, delta in allocation_events(prof):
        live += delta
        rise = max(rise, live)
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in wl.model.parameters()}
    # the timeline also counts the pre-existing tensors the step reads (parameters, batch)
    before = sum(params.values()) + sum(t.untyped_storage().nbytes() for t in iter_tensors(batch))
    assert timeline_peak(prof) == before + rise
