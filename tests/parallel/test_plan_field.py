"""``Plan.parallel``: JSON, describe, validation, and ``to_code`` run for real on a fake group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb import Plan
from memsave_nb.checkpointing import PlanError
from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.parallel.step import tracked_step

from .conftest import blocks_workload


def test_plan_parallel_json_round_trip_and_describe():
    plan = Plan(
        name="p",
        frozen=("blocks.0",),
        parallel=ParallelSpec(world_size=64, param_dtype="bfloat16", reduce_dtype="float32"),
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.parallel == plan.parallel
    assert "FSDP2 x64" in plan.describe() and "bfloat16" in plan.describe()
    assert not Plan(parallel={"world_size": 2}).is_empty
    assert "parallel" not in Plan().to_dict()  # plans without it serialise as before


@pytest.mark.parametrize("value", [{"world_size": -1}, {"wrold_size": 2}, 8, "fsdp"])
def test_bad_parallel_value_is_a_plan_error(value):
    with pytest.raises(PlanError, match="parallel"):
        Plan(parallel=value)


def test_measure_parallel_takes_the_spec_from_the_plan():
    wl = blocks_workload()
    plan = Plan(parallel=ParallelSpec(world_size=4))
    assert (
        measure_parallel(wl, plan=plan).worst.peak_split
        == measure_parallel(wl, ParallelSpec(world_size=4)).worst.peak_split
    )


@pytest.mark.parametrize(
    "spec",
    [
        ParallelSpec(world_size=4),
        ParallelSpec(world_size=4, shard_modules=("blocks.0",), reshard_after_forward=False),
        ParallelSpec(world_size=4, cpu_offload=True),
    ],
    ids=["suggested-units", "named-unit", "cpu-offload"],
)
def test_to_code_shards_like_the_prediction(spec):
    """Exec the snippet on a fresh real model on a fake group of 4 (rank 0), run the tracked step,
    and require the fake-mode prediction's bytes exactly."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    wl = blocks_workload()
    plan = Plan(frozen=("head",), parallel=spec)
    predicted = measure_parallel(wl, plan=plan, ranks=[0]).rank(0)
    fresh = blocks_workload()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=spec.world_size)
    try:
        ns = {"model": fresh.model}
        exec(compile(plan.to_code(), "<plan>", "exec"), ns)
        model = ns["model"]
        assert type(model).__name__.startswith("FSDP")
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        assert not model.head.weight.requires_grad
        measured = tracked_step(fresh, model, fresh.make_batch(), rank=0, ranks=(0,))
    finally:
        dist.destroy_process_group()
    assert measured.peak_bytes == predicted.peak_bytes
    assert measured.peak_split == predicted.peak_split
    assert (measured.device_peak_bytes, measured.host_peak_bytes) == (
        predicted.device_peak_bytes,
        predicted.host_peak_bytes,
    )
    assert (predicted.host_peak_bytes is not None) == spec.cpu_offload


def test_to_code_mixed_precision_and_ddp_lines():
    code = Plan(
        parallel=ParallelSpec(world_size=16, replicate=2, param_dtype="bfloat16", reduce_dtype="float32")
    ).to_code()
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "init_device_mesh(device_type, (2, 8)" in code
    ddp = Plan(parallel=ParallelSpec(world_size=8, strategy="ddp", bucket_cap_mb=50)).to_code()
    assert "DistributedDataParallel(model, bucket_cap_mb=50.0" in ddp
    compile(code, "<plan>", "exec")
    compile(ddp, "<plan>", "exec")
