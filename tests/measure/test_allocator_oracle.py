"""``measure()`` against the allocator's own record of the same step (``allocator_oracle.py``).

The loop is the one ``measure()`` runs today (engine ``_Step.run``), written out here: step 1 makes
the optimizer's state, gradients are set to None, then step 2 (forward, loss, backward, optimizer
step; the output lives as the workload's ``loop`` says, ``output_dropped``) is profiled. The batch of step 2 exists
before it, as in a training loop.

Allowed gap: the 0-dim "wrapped number" tensors C++ builds from Python scalars
(``WRAPPED_NUMBER_SLACK``, see ``test_oracles.py``); they never reach a dispatch mode.

CPU convolutions allocate workspaces below the dispatcher (oneDNN's reorders and scratchpad, the
im2col columns of float64): the engine measures them per signature (``measure/workspace.py``);
the grid below holds them to the allocator's record, forward and backward, real and fake.
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
    return Workload(
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.randn(8, 16, 32, 32),
        loss=lambda o: o.sum(),
        name="strided_conv",
    )


def _gpt_tiny() -> Workload:
    cfg = zoo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)
    return zoo.gpt(cfg, batch_size=2)


def _hf_llama() -> Workload:
    pytest.importorskip("transformers")
    return hf_models.llama()


def _lora_llama() -> Workload:
    pytest.importorskip("peft")
    return hf_models.lora_llama()


CASES = [
    pytest.param(_strided_conv, None, id="strided_conv"),
    pytest.param(lambda: zoo.make("cnn", batch_size=2), None, id="zoo_cnn"),
    pytest.param(_gpt_tiny, None, id="zoo_gpt"),
    pytest.param(_gpt_tiny, Plan(regions={"blocks.0": "full", "blocks.1": "full"}), id="zoo_gpt_full_ac"),
    pytest.param(_gpt_tiny, Plan(regions={"blocks.0": "save_matmuls", "blocks.1": "save_matmuls"}), id="zoo_gpt_sac"),
    pytest.param(
        _gpt_tiny,
        Plan(accumulation_steps=2, set_to_none=False, regions={"blocks.1": "full"}),
        id="zoo_gpt_accumulate_zeroed_grads_ac",
    ),
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


# (in, out, kernel, stride, bias, groups, input needs grad, layout, dtype): one convolution, batch 4 x 12^2
CONV_GRID = {
    "3x3_s1": (8, 16, 3, 1, True, 1, False, "nchw", torch.float32),
    "3x3_s2": (8, 16, 3, 2, True, 1, False, "nchw", torch.float32),
    "3x3_s2_no_bias": (8, 16, 3, 2, False, 1, False, "nchw", torch.float32),
    "3x3_s2_input_grad": (8, 16, 3, 2, True, 1, True, "nchw", torch.float32),
    "1x1_s1": (8, 16, 1, 1, True, 1, False, "nchw", torch.float32),
    "1x1_s2_no_bias": (8, 16, 1, 2, False, 1, True, "nchw", torch.float32),
    "3x3_groups_4": (8, 16, 3, 1, True, 4, True, "nchw", torch.float32),
    "depthwise": (8, 8, 3, 1, True, 8, True, "nchw", torch.float32),
    "stem_3_channels_7x7_s2": (3, 8, 7, 2, True, 1, False, "nchw", torch.float32),
    "odd_channels": (5, 7, 3, 1, True, 1, True, "nchw", torch.float32),
    "channels_last": (8, 16, 3, 2, True, 1, True, "channels_last", torch.float32),
    "bfloat16": (8, 16, 3, 2, True, 1, True, "nchw", torch.bfloat16),
    "float64_im2col": (8, 16, 3, 2, True, 1, True, "nchw", torch.float64),
}


def _one_conv(spec, batch: int = 4) -> Workload:
    c_in, c_out, k, stride, bias, groups, input_grad, layout, dtype = spec
    torch.manual_seed(0)
    conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=bias, groups=groups).to(dtype)
    x = torch.randn(batch, c_in, 12, 12, dtype=dtype)
    if layout == "channels_last":
        conv, x = conv.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return Workload(
        conv, x, loss=lambda o: o.float().sum(), optimizer="sgd", input_requires_grad=input_grad, name="conv"
    )


@pytest.mark.parametrize("spec", list(CONV_GRID.values()), ids=list(CONV_GRID))
def test_convolution_workspaces_are_the_allocators(spec):
    """Every convolution here allocates below the dispatcher; the peak is the allocator's to the
    byte, in real mode and in fake mode probing on its own (nothing measured before it)."""
    from memsave_nb.measure import workspace

    wl = _one_conv(spec)
    oracle = engine_loop_peak(wl).peak_bytes
    workspace._measured.clear()
    fake = measure(wl, "fake", repeats=0).peak_bytes
    real = measure(wl, repeats=0).peak_bytes
    with workspace.uncounted():
        unseen = oracle - measure(wl, repeats=0).peak_bytes
    assert unseen > 0  # what a dispatch-level count misses
    gap = oracle - real
    assert 0 <= gap <= WRAPPED_NUMBER_SLACK, f"allocator {oracle:,} B, measure() {real:,} B ({gap:+,})"
    assert fake == real


def test_oneDNN_switched_off_runs_another_kernel_measured_as_well():
    """With oneDNN off ATen runs its own im2col kernels: other workspaces, measured afresh (the
    switch is part of the signature), still the allocator's."""
    wl = _one_conv(CONV_GRID["3x3_s2_input_grad"])
    on = measure(wl, repeats=0).peak_bytes
    with torch.backends.mkldnn.flags(enabled=False):
        oracle = engine_loop_peak(wl).peak_bytes
        off = measure(wl, repeats=0).peak_bytes
    assert off != on and 0 <= oracle - off <= WRAPPED_NUMBER_SLACK


@pytest.mark.parametrize("name", ["1x1_s1", "channels_last", "stem_3_channels_7x7_s2", "float64_im2col"])
def test_a_fake_probe_over_the_cap_bounds_from_a_smaller_batch(monkeypatch, name):
    """Above ``PROBE_BYTES`` fake mode probes batch 16 of 64 and scales it up: never under."""
    from memsave_nb.measure import workspace

    wl = _one_conv(CONV_GRID[name], batch=64)
    oracle = engine_loop_peak(wl).peak_bytes
    workspace._measured.clear()
    monkeypatch.setattr(workspace, "PROBE_BYTES", 1)
    try:
        bound = measure(wl, "fake", repeats=0).peak_bytes
    finally:
        workspace._measured.clear()
    assert oracle <= bound <= 1.3 * oracle


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


def test_the_measurement_notes_say_how_workspaces_were_counted(monkeypatch):
    """A step with CPU convolutions says its workspaces are the CPU's (a GPU's cuDNN ones are not
    counted); a scaled fake probe says it is a bound; a step measured inside a running profiler
    says what it missed, and counts nothing it could not measure."""
    from torch.profiler import ProfilerActivity, profile

    from memsave_nb.measure import workspace

    assert not [n for n in measure(_gpt_tiny(), repeats=0).notes if "workspace" in n]
    wl = _one_conv(CONV_GRID["3x3_s2"], batch=32)
    notes = measure(wl, repeats=0).notes
    assert len([n for n in notes if "workspace" in n]) == 1 and "cuDNN" in notes[-1]
    workspace._measured.clear()
    monkeypatch.setattr(workspace, "PROBE_BYTES", 1)
    try:
        assert any("upper bound" in n for n in measure(wl, "fake", repeats=0).notes)
    finally:
        workspace._measured.clear()
    with workspace.uncounted():
        plain = measure(wl, repeats=0).peak_bytes
    with profile(activities=[ProfilerActivity.CPU]):
        inside = measure(wl, repeats=0)
    assert inside.peak_bytes == plain and any("profiler was already running" in n for n in inside.notes)
