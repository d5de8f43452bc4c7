"""Pipeline stages in the layout planner (planner/pp.py, planner/layout.py): a stage's depth cut and
extrapolated equals the full-depth measurement, the first and last stage stand for every stage, the
bubble is 1F1B's, the sends are counted, and a chosen PP layout is re-measured per rank."""

from __future__ import annotations

import pytest

from memsave_nb.checkpointing import PlanError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.parallel import ParallelSpec, measure_pipeline
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import blocks_of, extrapolate
from memsave_nb.planner.layout import plan_layout
from memsave_nb.planner.cost import step_cost
from memsave_nb.target import Target

from test_layout import _gpt  # the layout tests' seeded GPT (tests/tuner is on sys.path)

MIB = 2**20


def test_a_stage_cut_to_3_and_4_blocks_extrapolates_to_the_full_depth_measurement():
    """PP 2 x FSDP2 2, 1F1B, 2 micro-batches: the model cut to 6 and 8 blocks (3 and 4 per stage),
    extrapolated to 10, equals the 10-block measurement on every measured stage, category by category."""
    wl = _gpt(10, batch=2)
    blocks = blocks_of(wl.model)
    spec = ParallelSpec(world_size=4, pipeline_parallel=2, microbatches=2)

    def run(model, names):
        plan = Plan(regions={n: "full" for n in names})
        m = measure_pipeline(wl.replace(model=model), spec, plan)
        return {f"{r.rank}:{k}": float(v) for r in m.ranks for k, v in {"peak": r.device_bytes, **r.peak_split}.items()}

    guessed = extrapolate(wl.model, blocks, run, stages=2)
    whole = run(wl.model, blocks.names)
    assert {k: round(v) for k, v in guessed.items()} == {k: round(v) for k, v in whole.items()}


@pytest.fixture(scope="module")
def searched():
    wl = _gpt(4, batch=4)
    before = ModelSnapshot.capture(wl.model)
    # stage counts only: beside the other layouts a pipeline is measured only where its estimated
    # time could beat the fastest that fits (none of them here)
    result = plan_layout(
        wl,
        4,
        "H100",
        Target(2 * MIB / 2**30, headroom=1.0),
        tensor_parallel=(1, 2),
        pipeline_parallel=(2, 4),
        max_micro_batches=4,
        region_kinds=("full",),
    )
    return wl, before, result


def test_pipeline_layouts_are_searched_with_the_most_micro_batches(searched):
    wl, before, r = searched
    pp = {(c.spec.pipeline_parallel, c.spec.tensor_parallel): c for c in r.candidates if c.pipeline_stages > 1}
    # PP 4 x TP 2 needs 8 GPUs; PP 4 (4 micro-batches over 4 stages: a bubble of 3/4) is estimated
    # slower than PP 2 x TP 2, which fits: it is not measured
    assert set(pp) == {(2, 1), (2, 2)}
    assert any("not measured: even their fastest micro-batch is estimated slower" in n for n in r.notes)
    # PP 2 x FSDP2 2: 8 sequences per data-parallel rank, at most 4 micro-batches -> 4 of 2
    assert (pp[2, 1].spec.data_parallel, pp[2, 1].spec.microbatches, pp[2, 1].micro_batch) == (2, 4, 2)
    # PP 2 x TP 2: no data parallelism, 16 sequences -> 4 micro-batches of 4
    assert (pp[2, 2].spec.data_parallel, pp[2, 2].spec.microbatches, pp[2, 2].micro_batch) == (1, 4, 4)
    assert "TP collectives" in dict(pp[2, 2].comm_seconds)
    assert before.differences(wl.model) == []


def test_a_pipeline_candidates_peak_is_the_worst_stage_measured_at_full_depth(searched):
    """The planner measures the first and the last stage (cut, extrapolated where deep); every stage
    at full depth gives the same worst peak."""
    wl, _, r = searched
    for c in (c for c in r.candidates if c.pipeline_stages > 1):
        full = measure_pipeline(wl, c.spec, c.plan)
        assert c.est_peak_bytes == full.device_peak_bytes, c.label


def test_pipeline_time_holds_1f1b_bubble_and_the_sends(searched):
    """1F1B over p stages and m micro-batches: m busy slots and p - 1 idle ones, a slot being 1/p of
    one device's forward, backward and recomputation of a micro-batch; the sends are the hidden
    states the measured stage sent, one link each."""
    wl, _, r = searched
    names = blocks_of(wl.model).names
    for c in (c for c in r.candidates if c.pipeline_stages > 1):
        p, m = c.spec.pipeline_parallel, c.spec.microbatches
        cost = step_cost(wl, Plan(batch_size=c.micro_batch), names, r.device)
        one = cost.seconds["forward"] + cost.seconds["backward"] + sum(cost.recompute_seconds(n, "full") for n in names)
        # each send: one micro-batch's hidden state (micro-batch x 32 positions x 64 x 4 B), m of them
        sent = m * c.micro_batch * 32 * 64 * 4
        assert dict(c.comm_seconds)["PP send/recv"] == pytest.approx(sent / r.fabric.intra_bytes_per_second)
        if c.spec.tensor_parallel > 1:
            one /= c.spec.tensor_parallel  # TP splits each slot's work (the roofline, evenly)
        assert c.bubble_seconds == pytest.approx((p - 1) * one / p)
        assert c.compute_seconds >= (m + p - 1) * one / p


def test_only_pipeline_stages_choose_a_pipeline_layout_remeasured_per_rank():
    wl = _gpt(4, batch=2)
    r = plan_layout(
        wl,
        2,
        "H100",
        Target(64 * MIB / 2**30, headroom=1.0),
        pipeline_parallel=(2,),
        tensor_parallel=(1,),
        max_micro_batches=2,
        region_kinds=(None,),
    )
    c = r.chosen
    assert c is not None and c.pipeline_stages == 2 and c.spec.microbatches == 2
    assert len(r.remeasured.ranks) == 2  # every stage, at full depth
    assert r.remeasured.device_peak_bytes == c.est_peak_bytes == c.checked_peak_bytes
    assert "bubble" in r.summary() and "PP 2 (1F1B, 2 micro-batches)" in r.summary()


def test_bad_stage_counts_are_one_line():
    wl = _gpt(2, batch=2)
    for bad in ("2", [0], [2.0], []):
        with pytest.raises(PlanError, match="pipeline_parallel must be a list of stage counts"):
            plan_layout(wl, 2, "H100", pipeline_parallel=bad)


def test_the_largest_segment_peak_is_the_steps_peak():
    """The planner extrapolates each micro-batch phase's peak on its own (which phase holds the step's
    peak can change with depth); the largest of them, at the measured depth, is the step's peak."""
    m = measure_pipeline(_gpt(4, batch=4), ParallelSpec(world_size=4, pipeline_parallel=2, microbatches=4))
    for r in m.ranks:
        labels = [label for label, _ in r.segment_peaks]
        assert sum(label.startswith("forward") for label in labels) == 4 and "optimizer" in labels
        assert max(b for _, b in r.segment_peaks) == r.peak_bytes


def test_the_lower_bound_of_pipeline_x_fsdp2_holds_the_stage_unsharded():
    """torch's PipelineStage keeps FSDP2's parameters and gradients unsharded across micro-batches:
    the planner's lower bound counts them, and the measured peak is above it."""
    from memsave_nb.planner.layout_estimate import LayoutSearch
    from memsave_nb.planner.layout_measure import RankSizes
    from memsave_nb.planner.links import fabric_for
    from memsave_nb.planner.roofline import device_named

    wl = _gpt(4, batch=4)
    spec = ParallelSpec(world_size=4, pipeline_parallel=2, microbatches=4)
    search = LayoutSearch(
        RankSizes(wl, blocks_of(wl.model), device_named("H100")), fabric_for("H100"), Target(80), global_batch=16
    )
    bound = search.lower_bound(spec, None, None)
    total = sum(p.numel() * 4 for p in wl.model.parameters())
    assert bound >= 2 * total / 2  # parameters and gradients of a stage (half the model), unsharded
    measured = measure_pipeline(wl.replace(batch={k: v.repeat(2, 1) for k, v in wl.batch.items()}), spec)
    assert measured.device_peak_bytes >= bound


def test_the_lower_bound_of_a_pipeline_counts_the_first_stages_micro_batches_in_flight():
    """1F1B: the first stage holds min(m, p) micro-batches of its blocks' saved activations when its
    first backward starts; the bound counts them and the measured first stage is above it."""
    from memsave_nb.planner.layout_estimate import LayoutSearch
    from memsave_nb.planner.layout_measure import RankSizes
    from memsave_nb.planner.links import fabric_for
    from memsave_nb.planner.roofline import device_named

    wl = _gpt(4, batch=8)
    spec = ParallelSpec(world_size=2, pipeline_parallel=2, microbatches=4)  # micro-batches of 2
    search = LayoutSearch(
        RankSizes(wl, blocks_of(wl.model), device_named("H100")), fabric_for("H100"), Target(80), global_batch=8
    )
    one = search.sizes.saved_per_block(None, None)  # every block's saved activations at micro-batch 1
    assert search.lower_bound(spec, None, None) >= one / 2 * 2 * 2  # half the blocks, 2 in flight of 2 rows
    assert measure_pipeline(wl, spec).ranks[0].device_bytes >= search.lower_bound(spec, None, None)
