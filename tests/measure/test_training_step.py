"""One training step: every runner (engine, per-rank, compiled, pipeline) runs the loop written
once in ``measure/training_step.py``, and that loop is the loop a user writes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memsave_nb import Workload, measure
from memsave_nb.measure import compiled, step as engine_step
from memsave_nb.measure import training_step as ts
from memsave_nb.measure.compiled import measure_compiled
from memsave_nb.parallel import ParallelSpec, measure_parallel, measure_pipeline
from memsave_nb.parallel import pipeline, step as rank_step


def _mlp(**fields) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)
    )
    return Workload(model, torch.randn(8, 16), loss=lambda o: o.square().mean(), optimizer="adamw", **fields)


def test_every_runner_imports_the_same_function():
    assert engine_step.training_step is ts.training_step
    assert rank_step.training_step is ts.training_step
    assert compiled.training_step is ts.training_step
    assert pipeline.optimizer_step is ts.optimizer_step


def test_every_runner_runs_the_one_training_step():
    ts.CALLS.clear()
    measure(_mlp(), "fake", repeats=0)
    assert ts.CALLS["engine"] >= 1
    measure_parallel(_mlp(), ParallelSpec(world_size=2), ranks=[0])
    assert ts.CALLS["per_rank"] >= 1
    measure_compiled(_mlp(), repeats=0, warmup=0)
    assert ts.CALLS["compiled"] >= 1
    measure_pipeline(_mlp(), ParallelSpec(world_size=2, pipeline_parallel=2, microbatches=2), ranks=[0])
    assert ts.CALLS["pipeline"] >= 1
    assert set(ts.CALLS) == {"engine", "per_rank", "compiled", "pipeline"}


@pytest.mark.parametrize("loop", ["loss_only", "keep_output_step"])
def test_the_step_is_the_users_loop(loop):
    """Two accumulated micro-steps and an AdamW step through ``training_step`` leave the weights,
    to the bit, where the loop written by hand leaves them (oracle: plain torch)."""
    wl = _mlp(accumulation_steps=2, loop=loop)
    mine, theirs = wl.model, copy.deepcopy(wl.model)
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    feed = iter(batches)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-3)
    seen = []
    batch, output, loss = ts.training_step(
        wl, lambda last: next(feed), opt, runner="test", on_phase=lambda phase, last: seen.append(phase)
    )
    ref_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    for x in batches:
        ref_loss = theirs(x).square().mean() / 2
        ref_loss.backward()
    ref_opt.step()
    for a, b in zip(mine.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(loss, ref_loss) and batch is batches[1]
    assert (output is None) == (loop == "loss_only")
    assert seen == ["forward", "loss", "backward"] * 2 + ["optimizer", "done"]
    ts.CALLS.pop("test")
