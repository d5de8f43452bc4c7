"""Per-rank sizing in fake mode against PyTorch's FSDPMemTracker and exact analytic counts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memsave_nb import Plan
from memsave_nb.errors import WorkloadError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.parallel import ParallelError, ParallelSpec, measure_parallel
from memsave_nb.workload import iter_tensors

from .conftest import beyond_fsdp_mem_tracker, blocks_workload, fsdp_mem_tracker_peak, tiny_gpt


def _batch_bytes(workload) -> int:
    raw = workload.batch() if callable(workload.batch) else workload.batch
    return sum(t.untyped_storage().nbytes() for t in iter_tensors(raw))


@pytest.mark.parametrize("loop", ["loss_only", "keep_output_backward", "keep_output_step"])
def test_each_loop_per_rank_equals_fsdp_mem_tracker_on_that_loop(loop):
    """The per-rank step runs the workload's loop as the engine does (the output dropped before
    backward, before the step, or kept): FSDPMemTracker running the same loop agrees to the byte,
    and keeping the output raises the rank's peak over the default, as on one device."""
    wl = tiny_gpt().replace(loop=loop)
    spec = ParallelSpec(world_size=2)
    ours = measure_parallel(wl, spec, ranks=[0]).rank(0)
    assert ours.peak_bytes == fsdp_mem_tracker_peak(wl, spec)["Total"]
    if loop != "loss_only":
        assert ours.peak_bytes > measure_parallel(wl.replace(loop="loss_only"), spec, ranks=[0]).rank(0).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("regions", [False, True], ids=["eager", "ac-blocks"])
def test_rank_peak_equals_fsdp_mem_tracker(world_size, regions):
    """Byte-exact on a GPT (batch dict holds everything the loss uses), with and without AC."""
    wl = tiny_gpt()
    plan = Plan(regions={"blocks.0": "full", "blocks.1": "full"}) if regions else None
    spec = ParallelSpec(world_size=world_size)
    ours = measure_parallel(wl, spec, plan, ranks=[0]).rank(0)
    oracle = fsdp_mem_tracker_peak(wl, spec, plan)
    beyond_fsdp_mem_tracker(ours.peak_bytes, oracle["Total"], plan)  # checkpoint's RNG stashes: we see them
    split = ours.peak_split
    assert split["sharded_parameters"] == oracle.get("Sharded Param", 0)
    assert split["unsharded_parameters"] == oracle.get("Unsharded Param", 0)
    assert split["communication"] == oracle.get("All Gather", 0) + oracle.get("Reduce Scatter", 0)
    assert split["optimizer_state"] == oracle.get("OptState", 0)
    assert split["inputs"] == oracle.get("Inputs", 0)


def test_loss_closure_target_is_the_only_difference_from_fsdp_mem_tracker():
    """A target held by the loss closure is an input to us; FSDPMemTracker is only given the batch."""
    from memsave_nb import zoo

    wl = zoo.make("mlp", batch_size=16)
    spec = ParallelSpec(world_size=4)
    ours = measure_parallel(wl, spec, ranks=[0]).rank(0)
    oracle = fsdp_mem_tracker_peak(wl, spec)
    target_bytes = 16 * 8  # int64 class labels of the batch
    assert ours.peak_split["inputs"] == _batch_bytes(wl) + target_bytes
    assert ours.peak_bytes - oracle["Total"] == target_bytes


def test_doubling_world_size_halves_sharded_states_exactly():
    wl = blocks_workload()  # every dim 0 divisible by 8: even shards
    numel = sum(p.numel() for p in wl.model.parameters())
    n_params = len(list(wl.model.parameters()))
    ends = {}
    for ws in (2, 4, 8):
        m = measure_parallel(wl, ParallelSpec(world_size=ws))
        assert [r.ranks for r in m.ranks] == [tuple(range(ws))]  # one layout: all ranks equal
        ends[ws] = m.worst.end_split
        assert ends[ws]["sharded_parameters"] == numel * 4 // ws
        assert ends[ws]["gradients"] == numel * 4 // ws
        # AdamW: exp_avg and exp_avg_sq sharded, one 4-byte `step` per parameter (not sharded)
        assert ends[ws]["optimizer_state"] == 2 * numel * 4 // ws + 4 * n_params
    for ws in (2, 4):
        for c in ("sharded_parameters", "gradients"):
            assert ends[ws][c] == 2 * ends[2 * ws][c]


def test_uneven_shards_measure_each_layout_and_report_the_worst():
    wl = blocks_workload(width=64, hidden=128, out=10)  # head: 10 rows over 4 ranks = 3, 3, 3, 1
    m = measure_parallel(wl, ParallelSpec(world_size=4))
    assert [r.ranks for r in m.ranks] == [(0, 1, 2), (3,)]
    first, last = m.rank(0), m.rank(3)
    # the head's local shards: 3x64 weight + 3 bias rows on rank 0, 1x64 + 1 on rank 3
    assert first.end_split["optimizer_state"] - last.end_split["optimizer_state"] == 2 * 4 * (2 * 64 + 2)
    assert m.worst.rank == 0 and m.peak_bytes == first.peak_bytes > last.peak_bytes


def test_freezing_shrinks_gradients_and_optimizer_state_exactly():
    wl = blocks_workload()
    spec = ParallelSpec(world_size=4)
    full = measure_parallel(wl, spec).worst.end_split
    frozen = measure_parallel(wl, spec, Plan(frozen=("blocks.0",))).worst.end_split
    frozen_numel = sum(p.numel() for p in wl.model.blocks[0].parameters())
    assert full["gradients"] - frozen["gradients"] == frozen_numel * 4 // 4
    assert full["optimizer_state"] - frozen["optimizer_state"] == 2 * frozen_numel * 4 // 4 + 4 * 4
    assert frozen["sharded_parameters"] == full["sharded_parameters"]


def test_checkpointing_regions_shrink_saved_activations():
    wl = tiny_gpt()
    spec = ParallelSpec(world_size=4)
    eager = measure_parallel(wl, spec).worst
    ac = measure_parallel(wl, spec, Plan(regions={"blocks.0": "full", "blocks.1": "full"})).worst
    assert 0 < ac.saved_bytes < eager.saved_bytes


def test_process_group_never_leaks_and_a_second_measurement_works():
    wl = blocks_workload()
    assert not dist.is_initialized()
    a = measure_parallel(wl, ParallelSpec(world_size=4))
    assert not dist.is_initialized()
    b = measure_parallel(wl, ParallelSpec(world_size=4))
    assert not dist.is_initialized()
    assert a.worst.peak_split == b.worst.peak_split


def test_failing_step_leaves_no_process_group():
    wl = blocks_workload()
    bad = wl.replace(loss=lambda o: o)  # not a scalar
    with pytest.raises(WorkloadError, match="scalar"):
        measure_parallel(bad, ParallelSpec(world_size=2))
    assert not dist.is_initialized()
    assert measure_parallel(wl, ParallelSpec(world_size=2)).peak_bytes > 0


def test_an_existing_process_group_is_refused_and_kept(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ParallelError, match="already initialized"):
            measure_parallel(blocks_workload(), ParallelSpec(world_size=2))
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_users_model_is_untouched():
    wl = tiny_gpt()
    model = wl.model
    snap = ModelSnapshot.capture(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    measure_parallel(wl, ParallelSpec(world_size=4), Plan(frozen=("blocks.0",), regions={"blocks.1": "full"}))
    assert snap.differences(model) == []
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_unseen_lines_are_explicit():
    m = measure_parallel(blocks_workload(), ParallelSpec(world_size=2))
    names = [u.name for u in m.unseen]
    assert any("NCCL" in n for n in names) and any("CUDA context" in n for n in names)
    assert any("fragmentation" in n for n in names)
    assert any(n.startswith("kernel workspaces") for n in names)  # issue 33: what kernels allocate below dispatch
    assert all(u.source and u.high_bytes >= u.low_bytes for u in m.unseen)
    assert "NCCL" in m.table() and "worst rank" in m.table()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 6, "replicate": 4}, "replicate"),
        ({"strategy": "zero3"}, "strategy"),
        ({"param_dtype": "bf16"}, "param_dtype"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb"),
        ({"world_size": True}, "world_size"),
    ],
)
def test_bad_spec_is_one_line_error(kwargs, match):
    with pytest.raises(ParallelError, match=match):
        ParallelSpec(**kwargs)


def test_unknown_shard_module_is_refused():
    with pytest.raises(ParallelError, match="no module named 'nope'"):
        measure_parallel(blocks_workload(), ParallelSpec(world_size=2, shard_modules=("nope",)))
    assert not dist.is_initialized()


def test_spec_json_round_trip():
    spec = ParallelSpec(
        world_size=16, replicate=2, shard_modules=("blocks.0",), param_dtype="bfloat16", reduce_dtype="float32"
    )
    assert ParallelSpec.from_dict(spec.to_dict()) == spec
    assert spec.mesh_shape == (2, 8)
    with pytest.raises(ParallelError, match="unknown parallel field"):
        ParallelSpec.from_dict({"world": 2})


@pytest.mark.parametrize("case", ["mlp-uneven", "gpt-frozen-ac"])
def test_fast_steady_state_equals_a_full_first_step(case):
    """The default warm-up (optimizer step on zero grads) gives the very bytes of a full first step."""
    from memsave_nb import zoo

    if case == "mlp-uneven":
        wl, plan, ws = zoo.make("mlp", batch_size=16), None, 8  # 10 output rows over 8 ranks
    else:
        wl, plan, ws = tiny_gpt(), Plan(frozen=("blocks.0",), regions={"blocks.1": "full"}), 4
    full = measure_parallel(wl, ParallelSpec(world_size=ws), plan, steady="full")
    fast = measure_parallel(wl, ParallelSpec(world_size=ws), plan)
    assert len(full.ranks) == len(fast.ranks) >= 1
    for a, b in zip(full.ranks, fast.ranks):
        assert (a.ranks, a.peak_bytes, a.peak_split, a.end_split) == (b.ranks, b.peak_bytes, b.peak_split, b.end_split)


def test_hsdp_shards_over_the_shard_group_only():
    wl = blocks_workload()
    numel = sum(p.numel() for p in wl.model.parameters())
    m = measure_parallel(wl, ParallelSpec(world_size=8, replicate=4))  # mesh (4, 2)
    assert m.worst.end_split["sharded_parameters"] == numel * 4 // 2


def test_mixed_precision_halves_the_gathered_parameters():
    wl = blocks_workload()
    full = measure_parallel(wl, ParallelSpec(world_size=4)).worst.peak_split
    mixed = measure_parallel(
        wl, ParallelSpec(world_size=4, param_dtype="bfloat16", reduce_dtype="float32")
    ).worst.peak_split
    assert mixed["unsharded_parameters"] * 2 == full["unsharded_parameters"]
    assert mixed["sharded_parameters"] == full["sharded_parameters"]  # fp32 master shards stay


def test_cpu_offload_needs_fsdp():
    with pytest.raises(ParallelError, match="cpu_offload .* needs strategy 'fsdp'"):
        ParallelSpec(world_size=2, strategy="ddp", cpu_offload=True)


def test_measurements_from_two_threads_take_turns():
    import threading

    wl = blocks_workload()
    results, errors = [], []

    def run():
        try:
            results.append(measure_parallel(wl, ParallelSpec(world_size=2)).worst.peak_split)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert not dist.is_initialized()
