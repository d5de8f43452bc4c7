"""The layout planner (planner/layout.py): depth extrapolation against full-depth measurements,
the ranking by estimated time, the front, the chosen layout re-measured per rank under the
target, a layout that cannot fit never chosen, and bad input in one line."""

from __future__ import annotations

import time

import pytest
import torch

from memsave_nb.checkpointing import PlanError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import blocks_of, extrapolate
from memsave_nb.planner.layout import plan_layout
from memsave_nb.planner.links import FABRICS, ring_all_reduce
from memsave_nb.target import Target
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPT, GPTConfig

MIB = 2**20


def _gpt(n_layer: int, batch: int = 4) -> Workload:
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=n_layer, n_head=4, n_embd=64, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
        targets = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    return Workload(model, {"idx": idx, "targets": targets}, name="gpt")


TARGET = Target(2 * MIB / 2**30, headroom=1.0)  # 2 MiB per GPU: some layouts fit, the fastest do not


@pytest.fixture(scope="module")
def searched():
    wl = _gpt(2)
    before = ModelSnapshot.capture(wl.model)
    result = plan_layout(wl, 4, "H100", TARGET, tensor_parallel=(1, 2), max_micro_batches=4)
    return wl, before, result


def test_depth_extrapolation_equals_the_full_depth_measurement():
    """Per-rank peaks measured at 3 and 4 blocks, extrapolated to 6, equal the 6-block measurement
    (FSDP2 with checkpointed blocks, and TP 2 x FSDP2 2), category by category."""
    wl = _gpt(6, batch=2)
    blocks = blocks_of(wl.model)
    assert blocks.shallow and blocks.depth == 6 and blocks.list_name == "blocks"
    for spec, kind in ((ParallelSpec(world_size=4), "full"), (ParallelSpec(world_size=4, tensor_parallel=2), None)):

        def run(model, names):
            plan = Plan(regions={n: kind for n in names} if kind else {})
            m = measure_parallel(wl.replace(model=model), spec, plan)
            return {"peak": float(m.device_peak_bytes), **{k: float(v) for k, v in m.worst.peak_split.items()}}

        guessed = extrapolate(wl.model, blocks, run)
        whole = run(wl.model, blocks.names)
        assert {k: round(v) for k, v in guessed.items()} == {k: round(v) for k, v in whole.items()}, spec.describe()


def test_candidates_are_ranked_by_estimated_time_and_the_fastest_that_fits_is_chosen(searched):
    wl, before, r = searched
    times = [c.step_seconds for c in r.candidates]
    assert times == sorted(times) and len(r.candidates) > 5
    assert r.chosen is not None
    assert not any("estimated to fit" in n for n in r.notes)  # the first that fits passed its own check
    assert r.chosen.step_seconds == min(c.step_seconds for c in r.candidates if c.fits)
    assert before.differences(wl.model) == []  # the user's model as it was


def test_every_front_member_fits_and_none_is_dominated(searched):
    _, _, r = searched
    assert r.front and all(c.fits and c.est_peak_bytes <= TARGET.usable_bytes for c in r.front)
    fitting = r.fitting
    for c in r.front:
        assert not any(o.est_peak_bytes <= c.est_peak_bytes and o.step_seconds < c.step_seconds for o in fitting)
    assert r.chosen.step_seconds == r.front[-1].step_seconds  # the front's fastest end
    table = r.front_table()
    assert all(c.label in table for c in r.front)


def test_chosen_layout_remeasured_per_rank_stays_under_the_target(searched):
    wl, _, r = searched
    c = r.chosen
    assert r.remeasured is not None and TARGET.fits(r.remeasured.device_peak_bytes)
    # independently: the chosen plan measured again, by the public entry point
    k = min(c.accumulation, 2)
    m = measure_parallel(wl, c.plan.parallel, c.plan.replace(accumulation_steps=k if k > 1 else None))
    assert m.device_peak_bytes == r.remeasured.device_peak_bytes <= TARGET.usable_bytes
    code = r.to_code()
    assert "fully_shard" in code and "init_device_mesh" in code and f"batch_size = {c.micro_batch}" in code
    if c.accumulation > 1:
        assert f"accumulation_steps = {c.accumulation}" in code


def test_a_layout_that_cannot_fit_is_never_chosen(searched):
    wl, _, r = searched
    fastest = r.candidates[0]
    assert not fastest.fits and r.chosen is not fastest
    m = measure_parallel(wl, fastest.spec, fastest.plan.replace(accumulation_steps=None))
    assert m.device_peak_bytes > TARGET.usable_bytes  # the measurement agrees that it does not fit
    nothing = plan_layout(wl, 4, "H100", Target(64 * 1024 / 2**30, headroom=1.0), tensor_parallel=(1,), remeasure=False)
    assert nothing.chosen is None and nothing.front == [] and "no layout fits" in nothing.summary()
    with pytest.raises(PlanError, match="no layout fits"):
        nothing.to_code()


def test_the_fake_run_records_each_collective_s_payload():
    """``RankMeasurement.collectives`` against the analytic sizes: FSDP2 all-gathers the parameters
    twice (once without resharding) and reduce-scatters the gradients; HSDP all-reduces the gradient
    shard across replicas; DDP all-reduces the gradients; TP all-reduces a block's activation twice
    each way per block, plus the embedding's output and the head's input gradient, and gathers the
    logits once."""
    wl = _gpt(2)
    p = sum(t.numel() * t.element_size() for t in wl.model.parameters())
    # the root (embeddings, final norm, head) stays gathered after forward: torch's default (issue 40)
    root = sum(t.numel() * t.element_size() for n, t in wl.model.named_parameters() if not n.startswith("blocks."))

    def recorded(spec):
        return {(op, n): b for op, n, _, b in measure_parallel(wl, spec).worst.collectives}

    assert recorded(ParallelSpec(world_size=4)) == {
        ("c10d._allgather_base_", 4): 2 * p - root,
        ("c10d._reduce_scatter_base_", 4): p,
    }
    assert recorded(ParallelSpec(world_size=4, reshard_root=True)) == {
        ("c10d._allgather_base_", 4): 2 * p,
        ("c10d._reduce_scatter_base_", 4): p,
    }
    assert recorded(ParallelSpec(world_size=4, reshard_after_forward=False)) == {
        ("c10d._allgather_base_", 4): p,
        ("c10d._reduce_scatter_base_", 4): p,
    }
    assert recorded(ParallelSpec(world_size=8, replicate=2))[("c10d.allreduce_", 2)] == p // 4
    assert recorded(ParallelSpec(world_size=4, strategy="ddp")) == {("c10d.allreduce_", 4): p}
    tp = recorded(ParallelSpec(world_size=4, tensor_parallel=2))
    act = 4 * 32 * 64 * 4  # batch x sequence x width, fp32
    assert tp[("_c10d_functional.all_reduce", 2)] == (2 * 4 + 2) * act
    assert tp[("_c10d_functional.all_gather_into_tensor", 2)] == 4 * 32 * 256 * 4  # the logits


def test_communication_follows_the_ring_factors_over_the_stated_links():
    wl = _gpt(2)
    r = plan_layout(
        wl,
        16,
        "A100",
        Target(80),
        tensor_parallel=(1,),
        remeasure=False,
        region_kinds=(None,),
        max_micro_batches=1,
        global_batch=64,
    )
    trainable = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    ddp = next(c for c in r.candidates if c.spec.strategy == "ddp")
    seconds = dict(ddp.comm_seconds)["DDP all-reduce"]
    assert seconds == pytest.approx(ring_all_reduce(trainable, 16) / FABRICS["A100"].inter_bytes_per_second)
    assert ring_all_reduce(trainable, 16) == pytest.approx(2 * 15 / 16 * trainable)
    fsdp = next(c for c in r.candidates if c.spec == ParallelSpec(world_size=16))
    gathered = dict(fsdp.comm_seconds)["FSDP2 all-gather/reduce-scatter"]
    # two all-gathers (the root's once: torch's default keeps it gathered after forward) and a
    # reduce-scatter over InfiniBand (FSDP2 pads each shard: within 2%)
    root = sum(t.numel() * t.element_size() for n, t in wl.model.named_parameters() if not n.startswith("blocks."))
    assert gathered == pytest.approx((3 * trainable - root) * 15 / 16 / 25e9, rel=0.02)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpus=6, tensor_parallel=(4,)), "tensor_parallel 4: 6 GPUs are not divisible by it"),
        (dict(gpus=16, tensor_parallel=(16,)), "tensor_parallel 16: it spans more than a node of 8"),
        (dict(gpus=8, gpu="V100"), "gpu 'V100': choose one of"),
        (dict(gpus=0), "gpus must be a whole number"),
        (dict(gpus=8, region_kinds=("sometimes",)), "region kind 'sometimes'"),
        (dict(gpus=8, global_batch=0), "global_batch must be"),
    ],
)
def test_bad_input_is_one_line(kwargs, message):
    wl = _gpt(2)
    before = ModelSnapshot.capture(wl.model)
    start = time.process_time()
    with pytest.raises(PlanError) as info:
        plan_layout(wl, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert time.process_time() - start < 2  # found before any measurement
    assert before.differences(wl.model) == []


@pytest.mark.slow
def test_llama_70b_on_16_h100s_under_60_s_cpu():
    """The issue's must-show: a Llama-3.1-70B-shaped model (fake, seq 4096) on 16 x H100 80 GB; the
    chosen layout re-measured per rank at full depth stays under the target; the search and that
    re-measurement together take under 60 s of CPU time here (40-49 s; 63-68 s with TP's old
    whole-first-step warm-up, bench_layout.py --baseline)."""
    from memsave_nb import from_pretrained

    wl = from_pretrained("llama-3.1-70b", batch_size=1, seq_len=4096)
    target = Target(80)
    r = plan_layout(wl, 16, "H100", target)
    assert r.chosen is not None and r.remeasured is not None
    assert target.fits(r.remeasured.device_peak_bytes)
    assert r.cpu_seconds < 60  # the search and the re-measurement together
    assert abs(r.remeasured.device_peak_bytes - r.chosen.checked_peak_bytes) <= 2**20  # the extrapolation held
    assert r.front and r.chosen.label in r.front_table()


@pytest.mark.slow
def test_cli_plan_gpus_prints_the_chosen_layout_and_the_front_first(capsys):
    from memsave_nb.cli import main

    rc = main(
        [
            "plan",
            "--model",
            "gpt",
            "--batch",
            "1",
            "--gpus",
            "4",
            "--gpu",
            "H100",
            "--tp",
            "1,2",
            "--target-gb",
            "0.008",
            "--headroom",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert (
        out.index("chosen:")
        < out.index("Pareto front")
        < out.index("The chosen layout measured per rank")
        < out.index("as code")
    )
    assert "re-measured per rank at full depth" in out and "fits" in out
    assert "init_device_mesh" in out  # the layout as code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "6", "--tp", "4"], "tensor_parallel 4: 6 GPUs are not divisible by it"),
        (["--gpus", "8", "--gpu", "V100"], "invalid choice: 'V100'"),
        (["--tp", "2"], "--tp needs --gpus N"),
        (["--gpus", "8", "--micro-batches", "1,2"], "drop --micro-batches"),
    ],
)
def test_cli_plan_gpus_bad_input_is_one_line(capsys, argv, message):
    from memsave_nb.cli import main

    assert main(["plan", "--model", "gpt", "--target-gb", "80", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_when_every_checked_candidate_is_over_the_summary_does_not_say_nothing_fits():
    """Estimated to fit, measured over at their micro-batch: the front still lists the estimates,
    so the summary says the checks refused them rather than "no layout fits" beside a full front."""
    r = plan_layout(_gpt(4), 2, "H100", TARGET, remeasure=False)
    assert r.chosen is None and r.fitting  # the case: every checked candidate measured over
    text = r.summary()
    assert "no layout fits" not in text and "no layout chosen" in text
    assert sum("estimated to fit, measured" in n for n in r.notes) >= 1
