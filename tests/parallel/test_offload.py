"""FSDP2 CPU offload: the step's bytes split into host and device from FSDP2's own records.

Oracles: FSDPMemTracker on the same fake setup (totals and its per-category split), the same model
without offload, an analytic count of the shards, gradients and AdamW state, and real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.cli.gloo import cross_check, markdown_table

from .conftest import blocks_workload, fsdp_mem_tracker_peak, tiny_gpt

# Blocks(64, 128, 64): every dim 0 divides by 2 and 4 (even shards); 10 parameter tensors
BLOCKS_NUMEL = 2 * (64 * 128 + 128 + 128 * 64 + 64) + 64 * 64 + 64
BLOCKS_TENSORS = 10
BLOCK_NUMEL = 64 * 128 + 128 + 128 * 64 + 64  # the largest FSDP unit


def _host_states(numel: int, tensors: int, world_size: int) -> tuple[int, int, int]:
    """fp32 shard bytes, gradient-shard bytes, AdamW state bytes (exp_avg, exp_avg_sq, 4-byte step)."""
    shard = numel * 4 // world_size
    return shard, shard, 2 * shard + 4 * tensors


@pytest.mark.slow
def test_offload_total_equals_fsdp_mem_tracker_and_device_excludes_host_states():
    wl = tiny_gpt()
    spec = ParallelSpec(world_size=2, cpu_offload=True)
    oracle = fsdp_mem_tracker_peak(wl, spec)
    off = measure_parallel(wl, spec).worst
    plain = measure_parallel(wl, ParallelSpec(world_size=2)).worst
    # on a CPU mesh FSDP2's copies are no-ops: the same storages, with or without offload
    assert off.peak_bytes == plain.peak_bytes == oracle["Total"]
    host_at_total_peak = oracle["Sharded Param"] + oracle["Sharded Grad"] + oracle["OptState"]
    # the tiny GPT's peak is in backward before any gradient shard exists, and the device peak is
    # that moment minus FSDP2's host storages: exact, against FSDPMemTracker's own categories
    assert oracle["Sharded Grad"] == 0
    assert off.device_peak_bytes == oracle["Total"] - host_at_total_peak
    assert off.device_peak_split["sharded_parameters"] == off.device_peak_split["optimizer_state"] == 0
    assert off.device_peak_split["unsharded_parameters"] == oracle["Unsharded Param"]
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size", [2, 4])
def test_offload_lowers_the_device_peak_by_at_least_the_host_states(world_size):
    wl = blocks_workload()
    off = measure_parallel(wl, ParallelSpec(world_size=world_size, cpu_offload=True)).worst
    plain = measure_parallel(wl, ParallelSpec(world_size=world_size)).worst
    shard, grad, opt = _host_states(BLOCKS_NUMEL, BLOCKS_TENSORS, world_size)
    assert plain.peak_split["sharded_parameters"] == shard and plain.peak_split["optimizer_state"] == opt
    assert off.peak_bytes == plain.peak_bytes
    # shards and AdamW state live through the whole step on the host: the device peak is lower by them
    assert off.device_peak_bytes <= plain.peak_bytes - shard - opt
    # ... and at most by everything the host holds at the total peak (gradient shards included)
    at_peak = plain.peak_split
    assert (
        off.device_peak_bytes
        >= plain.peak_bytes - at_peak["sharded_parameters"] - at_peak["gradients"] - at_peak["optimizer_state"]
    )
    # the host holds the shards, the gradient shards and the AdamW state at the end of the step, exactly
    end = off.end_split
    assert (end["sharded_parameters"], end["gradients"], end["optimizer_state"]) == (shard, grad, opt)
    assert off.host_peak_bytes >= shard + grad + opt
    assert off.peak_bytes <= off.device_peak_bytes + off.host_peak_bytes


def test_offload_unseen_copies_are_bounded_by_the_largest_unit():
    wl = blocks_workload()
    m = measure_parallel(wl, ParallelSpec(world_size=4, cpu_offload=True))
    lines = {u.name.split(":")[1].strip().split(" (")[0]: u for u in m.unseen if u.name.startswith("CPU offload")}
    h2d = lines["device copy of each shard before its all-gather"]
    d2h = lines["device gradient shards before their copy to the host"]
    block_shard = BLOCK_NUMEL * 4 // 4
    assert (h2d.low_bytes, h2d.high_bytes) == (0, block_shard)
    assert (d2h.low_bytes, d2h.high_bytes) == (0, block_shard)
    # with a bf16 param dtype the cast is seen; only one fp32 shard (the largest weight) is not
    mixed = measure_parallel(wl, ParallelSpec(world_size=4, cpu_offload=True, param_dtype="bfloat16"))
    h2d_mixed = next(u for u in mixed.unseen if "all-gather" in u.name)
    assert h2d_mixed.high_bytes == 64 * 128 * 4 // 4
    text = m.table()
    assert "device peak" in text and "host peak" in text and "estimate, upper bound" in text
    assert "host memory per rank (worst): " in text
    plain = measure_parallel(wl, ParallelSpec(world_size=4))
    assert not any(u.name.startswith("CPU offload") for u in plain.unseen)
    assert plain.worst.device_peak_bytes is None and plain.device_peak_bytes == plain.peak_bytes


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_gloo_ranks_with_offload_measure_the_predicted_host_and_total():
    tables = []
    for _attempt in range(3):  # gloo's worker-thread timing, as in test_gloo.py
        rows = cross_check("tiny-gpt", ParallelSpec(world_size=2, cpu_offload=True))
        tables.append(markdown_table(rows))
        for r in rows:
            assert r.predicted_bytes <= r.comparable_bytes <= r.predicted_bytes * 1.05, tables[-1]
            assert r.measured_host_bytes == r.predicted_host_bytes is not None, tables[-1]
        if all(r.comparable_bytes == r.predicted_bytes for r in rows):
            break
    else:
        pytest.fail("no attempt was byte-exact:\n" + "\n".join(tables))
    assert not dist.is_initialized()


def test_report_cpu_offload_prints_host_and_device(capsys):
    from memsave_nb import zoo
    from memsave_nb.cli import main

    assert main(["report", "--model", "mlp", "--batch", "8", "--world-size", "4", "--cpu-offload"]) == 0
    out = capsys.readouterr().out
    assert measure_parallel(zoo.make("mlp", 8), ParallelSpec(world_size=4, cpu_offload=True)).table() in out
    assert "device peak" in out and "host memory per rank" in out
    assert main(["report", "--model", "mlp", "--world-size", "4", "--ddp", "--cpu-offload"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cpu-offload" in err


def test_gpus_tab_offload_checkbox_shows_the_device_peak_and_host_memory():
    from memsave_nb import Plan
    from memsave_nb.ui.parallel_panel import ParallelPanel, spec_for

    assert spec_for(8, "fsdp", True, True) == ParallelSpec(
        world_size=8, param_dtype="bfloat16", reduce_dtype="float32", cpu_offload=True
    )
    wl = blocks_workload()
    panel = ParallelPanel(wl, plan_fn=lambda: Plan(), live=False)
    panel.gpus.value = 4
    panel.offload.value = True
    panel.refresh()
    expected = measure_parallel(wl, ParallelSpec(world_size=4, cpu_offload=True))
    assert panel.result.device_peak_bytes == expected.device_peak_bytes < expected.peak_bytes
    from memsave_nb.ui.format import format_bytes

    assert f"{format_bytes(expected.device_peak_bytes)} counted on the GPU" in panel.peak.value  # units per value
    assert "host memory" in panel.peak.value
    panel.sharding.value = "ddp"
    panel.refresh()
    assert "CPU offload" in panel.error.value and "FSDP2" in panel.error.value


def test_a_cold_sharding_propagation_cache_changes_nothing():
    """DTensor runs each new op signature once on fake global-shape tensors under the active fake
    mode (ours) to learn its output metadata; those ops are not the rank's and must not be counted:
    the first measurement in a process equals a later one."""
    from torch.distributed.tensor import DTensor

    from memsave_nb.parallel import measure_rank

    spec = ParallelSpec(world_size=2, cpu_offload=True)
    first = measure_rank(tiny_gpt(), spec, rank=0)  # cold or warm, depending on the tests before
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_cached.cache_clear()
    propagator.propagate_op_sharding.cache_clear()
    cold = measure_rank(tiny_gpt(), spec, rank=0)
    assert (cold.peak_bytes, cold.host_peak_bytes, cold.device_peak_bytes, cold.events) == (
        first.peak_bytes,
        first.host_peak_bytes,
        first.device_peak_bytes,
        first.events,
    )
