"""``memsave-nb report --world-size N --fsdp``: the per-rank table, its numbers from measure_parallel."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb import zoo
from memsave_nb.cli import main
from memsave_nb.parallel import ParallelSpec, measure_parallel


@pytest.mark.slow
def test_report_world_size_fsdp_prints_the_per_rank_table(capsys):
    assert main(["report", "--model", "mlp", "--batch", "8", "--world-size", "8", "--fsdp"]) == 0
    out = capsys.readouterr().out
    expected = measure_parallel(zoo.make("mlp", 8), ParallelSpec(world_size=8))
    assert expected.table() in out
    assert "FSDP2 x8" in out and "NCCL" in out and "CUDA context" in out
    assert not dist.is_initialized()


def test_report_parallel_mistakes_are_one_line(capsys):
    assert main(["report", "--model", "mlp", "--fsdp"]) == 2
    assert "--world-size" in capsys.readouterr().err
    assert main(["report", "--model", "mlp", "--world-size", "2", "--fsdp", "--ddp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not allowed with" in err
