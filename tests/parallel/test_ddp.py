"""Classic DDP sized in fake mode: its C++ reducer's gradient buckets against exact counts, the
bucket rebuild, the GPUs tab and the CLI; the real gloo run is the oracle (test_gloo.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb import Plan
from memsave_nb.parallel import ParallelError, ParallelSpec, measure_parallel

from .conftest import blocks_workload, tiny_gpt


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("view", [False, True], ids=["buckets+grads", "grads-as-bucket-views"])
def test_ddp_buckets_hold_every_trainable_gradient_once(view):
    """Buckets: one flat copy of the trainable gradients. ``gradient_as_bucket_view`` makes
    ``param.grad`` views of them, so the second copy (the separate gradients) goes."""
    wl = blocks_workload()
    model = wl.model
    trainable = _bytes(p for n, p in model.named_parameters() if not n.startswith("blocks.0."))
    n_trainable = sum(1 for n, _ in model.named_parameters() if not n.startswith("blocks.0."))
    m = measure_parallel(
        wl, ParallelSpec(world_size=4, strategy="ddp", gradient_as_bucket_view=view), Plan(frozen=("blocks.0",))
    )
    assert [r.ranks for r in m.ranks] == [(0, 1, 2, 3)]  # DDP replicates: every rank the same
    end = m.worst.end_split
    assert end["sharded_parameters"] == _bytes(model.parameters())  # the whole replica
    assert end["gradients"] == trainable
    assert end["communication"] == (0 if view else trainable)  # the buckets, unless they are the grads
    assert end["optimizer_state"] == 2 * trainable + 4 * n_trainable  # AdamW, `step` per parameter
    assert not dist.is_initialized()


def test_gradient_as_bucket_view_saves_one_gradient_copy_at_the_peak():
    wl = tiny_gpt()
    spec = ParallelSpec(world_size=2, strategy="ddp")
    buckets = measure_parallel(wl, spec).worst
    views = measure_parallel(wl, ParallelSpec(world_size=2, strategy="ddp", gradient_as_bucket_view=True)).worst
    assert views.end_split["communication"] == 0
    assert buckets.end_split["communication"] == views.end_split["gradients"] == _bytes(wl.model.parameters())
    assert views.peak_bytes <= buckets.peak_bytes
    # replicas: the world size changes nothing per rank under DDP
    assert measure_parallel(wl, ParallelSpec(world_size=8, strategy="ddp")).worst.peak_split == buckets.peak_split


@pytest.mark.parametrize("view", [False, True])
def test_ddp_steady_state_comes_after_the_bucket_rebuild(view):
    """DDP re-buckets in gradient-ready order at the first forward after a backward (small cap:
    several buckets). The steady state runs a whole first step and that rebuild before tracking,
    so a tracked step with accumulation (a second forward) meets no rebuild in fake mode."""
    from memsave_nb.parallel import measure_rank

    wl = tiny_gpt()
    spec = ParallelSpec(world_size=2, strategy="ddp", bucket_cap_mb=0.1, gradient_as_bucket_view=view)
    plan = Plan(frozen=("blocks.0",), regions={"blocks.1": "full"})
    steady = measure_parallel(wl, spec, plan).worst
    full = measure_parallel(wl, spec, plan, steady="full").worst
    assert (full.peak_bytes, full.peak_split, full.end_split) == (
        steady.peak_bytes,
        steady.peak_split,
        steady.end_split,
    )
    acc = measure_rank(wl, spec, Plan(frozen=("blocks.0",), accumulation_steps=2))
    assert acc.end_split["gradients"] == steady.end_split["gradients"]
    assert not dist.is_initialized()


def test_ddp_to_code_runs_on_a_real_group(tmp_path):
    """The snippet builds the DDP the prediction sized (one-rank gloo group: real tensors)."""
    from torch.nn.parallel import DistributedDataParallel

    code = Plan(
        parallel=ParallelSpec(world_size=1, strategy="ddp", bucket_cap_mb=50, gradient_as_bucket_view=True)
    ).to_code()
    assert "DistributedDataParallel(model, bucket_cap_mb=50.0, gradient_as_bucket_view=True" in code
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ns = {"model": blocks_workload().model}
        exec(compile(code, "<plan>", "exec"), ns)
        ddp = ns["model"]
        assert isinstance(ddp, DistributedDataParallel)
        assert ddp.gradient_as_bucket_view and ddp.bucket_bytes_cap == 50 * 1024 * 1024
    finally:
        dist.destroy_process_group()


def test_gpus_panel_sizes_ddp():
    pytest.importorskip("ipywidgets")
    from memsave_nb.ui.parallel_panel import ParallelPanel, spec_for

    assert spec_for(4, "ddp-view", False) == ParallelSpec(world_size=4, strategy="ddp", gradient_as_bucket_view=True)
    with pytest.raises(ParallelError, match="MixedPrecisionPolicy"):
        spec_for(4, "ddp", True)
    wl = blocks_workload()
    panel = ParallelPanel(wl, plan_fn=lambda: None, live=False)
    panel.gpus.value, panel.sharding.value = 4, "ddp"
    panel.refresh()
    assert panel.error.value == "" and "DDP x4" in panel.table.value
    assert (
        panel.result.worst.peak_split
        == measure_parallel(wl, ParallelSpec(world_size=4, strategy="ddp")).worst.peak_split
    )


def test_report_world_size_ddp(capsys):
    from memsave_nb import zoo
    from memsave_nb.cli import main

    assert main(["report", "--model", "mlp", "--batch", "8", "--world-size", "4", "--ddp"]) == 0
    out = capsys.readouterr().out
    assert measure_parallel(zoo.make("mlp", 8), ParallelSpec(world_size=4, strategy="ddp")).table() in out
    assert "DDP x4" in out and not dist.is_initialized()
    assert (
        main(["report", "--model", "mlp", "--batch", "8", "--world-size", "4", "--ddp", "--gradient-as-bucket-view"])
        == 0
    )
    assert "gradients as bucket views" in capsys.readouterr().out
    assert main(["report", "--model", "mlp", "--world-size", "4", "--gradient-as-bucket-view"]) == 2
    assert "needs --ddp" in capsys.readouterr().err
