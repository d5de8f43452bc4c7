"""The planner: cost model against torch's FLOP counter, Pareto front against brute force,
estimated peaks against full measurements, the chosen plan re-measured under the target."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memsave_nb import presets, zoo
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.planner import GPUS, Device, pareto_front, plan_for, step_cost
from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, fit_of, measure_peak

BLOCKS = [f"blocks.{i}" for i in range(4)]


def test_pareto_front_matches_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(rng.randint(1, 30))]
        front = pareto_front(pts, key=lambda p: p)
        brute = {p for p in pts if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in pts)}
        assert set(front) == brute


def test_roofline_compute_and_memory_bound():
    d = Device("toy", 100.0, 10.0, 1000.0, 1, launch_seconds=0.0)
    assert d.op_seconds(1000, 10, low_precision=True) == 10.0  # compute-bound at 100 FLOP/s
    assert d.op_seconds(1000, 10, low_precision=False) == 100.0
    assert d.op_seconds(10, 100000, low_precision=True) == 100.0  # memory-bound at 1000 B/s
    assert set(GPUS) == {"H100", "H200", "A100", "A100-40", "L4", "RTX 4090"} and all(g.source for g in GPUS.values())


def test_step_cost_flops_equal_torch_flop_counter():
    wl = zoo.gpt(zoo.GPTConfig(dropout=0.0), batch_size=2)
    cost = step_cost(wl, Plan(), BLOCKS, GPUS["H100"])
    counter = FlopCounterMode(display=False)
    with counter:
        loss = wl.compute_loss(wl.forward(wl.make_batch()))
    forward = counter.get_total_flops()
    with counter:
        loss.backward()
    backward = counter.get_total_flops()
    for p in wl.model.parameters():
        p.grad = None
    assert cost.flops["forward"] == forward
    assert cost.flops["backward"] == backward
    # recomputing a block costs its forward; saving its matmuls leaves only the rest
    parts = cost.region_forward["blocks.1"]
    assert cost.recompute_seconds("blocks.1", "full") == pytest.approx(parts["matmul"] + parts["other"])
    assert 0 < cost.recompute_seconds("blocks.1", "save_matmuls") < cost.recompute_seconds("blocks.1", "full")


@pytest.mark.slow
def test_planner_estimates_and_choice_in_fake_mode():
    wl = zoo.make("gpt", 8)
    before = ModelSnapshot.capture(wl.model)
    base = measure_peak(wl, Plan())
    # the baseline does not fit: the GPU holds the CUDA context and 75% of the baseline's peak
    target = Target((CUDA_CONTEXT_BYTES + base.peak_bytes * 0.75) / 2**30)
    result = plan_for(
        wl,
        target,
        mode="fake",
        device="A100",
        freezing={"all": Plan(), "last": presets.last_blocks(wl.model, 1)},
        precisions=(None,),
        micro_batches=(1, 2),
    )
    assert before.differences(wl.model) == []
    assert len(result.candidates) > 50
    baseline = next(
        c
        for c in result.candidates
        if c.plan.replace(name="") == Plan().replace(frozen=(), trainable=())
        or c.plan.describe() == "baseline (no changes)"
    )
    assert not baseline.fits
    chosen = result.chosen
    assert chosen is not None and chosen.fits and "allocator replay" in chosen.measured_verdict
    # the oracle: the report's verdict on the chosen plan measured afresh, and the baseline's
    again = measure_peak(wl, chosen.plan)
    assert again.peak_bytes == chosen.measured_peak_bytes and fit_of(target, again).fits
    assert not fit_of(target, base).fits
    # nothing that fits by estimate is estimated faster than the chosen one, except those re-measured and refused
    refused = {c.plan for c in result.remeasured if c is not chosen and not c.fits}
    assert all(c.est_seconds >= chosen.est_seconds or c.plan in refused for c in result.fitting)
    # the estimate tracks full measurements (independent: one whole step per plan)
    rng = random.Random(1)
    for c in rng.sample(result.candidates, 8):
        real = measure_peak(wl, c.plan).peak_bytes
        assert abs(c.est_peak_bytes - real) / real < 0.2, (c.label, c.est_peak_bytes, real)
    # the front: no candidate beats a front member on both axes
    for f in result.front:
        assert not any(c.est_peak_bytes < f.est_peak_bytes and c.est_seconds < f.est_seconds for c in result.candidates)


@pytest.mark.slow
def test_compile_budgets_are_real_mode_candidates():
    from torch import nn

    from memsave_nb.workload import Workload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    wl = Workload(model, torch.randn(32, 64))
    fake = plan_for(wl, Target(1), mode="fake", compile_budgets=(0.5,), remeasure=0)
    assert any("real mode only" in n for n in fake.notes) and not any(c.plan.compiled for c in fake.candidates)
    real = plan_for(wl, Target(1), mode="real", device="host", compile_budgets=(0.0, 1.0), remeasure=0)
    compiled = [c for c in real.candidates if c.plan.compiled]
    assert sorted(c.plan.compile_budget for c in compiled) == [0.0, 1.0]
    for c in compiled:
        assert c.measured_seconds > 0 and c.est_peak_bytes == c.measured_peak_bytes
        again = measure_peak(wl, c.plan, "real")
        assert again.peak_bytes == pytest.approx(c.measured_peak_bytes, rel=0.02)


def test_planner_passes_on_the_single_tensor_optimizer_caveat():
    """Fake mode on the CPU runs AdamW's single-tensor step; the planner's notes say so (once), and
    not when the workload asks for the GPU's foreach step itself."""
    import torch

    from memsave_nb import zoo
    from memsave_nb.planner import plan_for
    from memsave_nb.target import Target

    cfg = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    default = plan_for(zoo.gpt(cfg, batch_size=4), Target(1), remeasure=0, region_kinds=("full",))
    assert sum("single-tensor step" in n for n in default.notes) == 1
    gpu = zoo.gpt(cfg, batch_size=4).replace(optimizer=lambda p: torch.optim.AdamW(p, foreach=True))
    foreach = plan_for(gpu, Target(1), remeasure=0, region_kinds=("full",))
    assert not any("single-tensor step" in n for n in foreach.notes)


def test_candidates_labels_tell_plans_apart():
    """Mirror-image assignments (the first regions one kind, the rest another, and the reverse)
    are different plans: their labels differ, and say which region takes which kind."""
    wl = zoo.make("gpt", 4)
    result = plan_for(wl, Target(1), mode="fake", remeasure=0, region_kinds=("full", "offload"))
    by_label: dict[str, Plan] = {}
    for c in result.candidates:
        assert by_label.setdefault(c.label, c.plan) == c.plan, c.label
    labels = {c.label for c in result.candidates}
    assert "full blocks.0-1; offload blocks.2-3" in labels, sorted(labels)
    assert "offload blocks.0-1; full blocks.2-3" in labels
