"""``memsave-nb report --world-size N --fsdp``: the per-rank table, its numbers from measure_parallel."""

from __future__ import annotations

import pytest
import torch
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


def test_report_tp_prints_the_2d_layout_and_the_numbers_of_measure_parallel(capsys):
    """``--tp 2 --world-size 4``: the per-rank answer for TP 2 x FSDP2 2 on the zoo GPT, equal to
    measure_parallel with the same spec (the table is the same object's text). The verdict is the
    allocator replay's: at 1 GB the CUDA context and two communicators' buffers (1.5 GiB) already do
    not fit; at 2 GB the rank does."""
    assert main(["report", "--model", "gpt", "--batch", "2", "--world-size", "4", "--tp", "2", "--target-gb", "1"]) == 0
    assert "does not fit (1.5 GiB of 1.0 GiB; allocator replay" in capsys.readouterr().out.splitlines()[3]
    assert main(["report", "--model", "gpt", "--batch", "2", "--world-size", "4", "--tp", "2", "--target-gb", "2"]) == 0
    out = capsys.readouterr().out
    expected = measure_parallel(zoo.make("gpt", 2), ParallelSpec(world_size=4, tensor_parallel=2))
    head = out.splitlines()[0]
    assert "TP 2 x FSDP2 2 (4 ranks, mesh 2x2)" in head
    assert expected.table() in out
    assert out.splitlines()[3].startswith("Target 2 GB per rank: fits (1.5 GiB of 2.0 GiB; allocator replay")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "2"], "--world-size"),
        (["--world-size", "4", "--sequence-parallel"], "--tp 2"),
        (["--world-size", "4", "--tp", "2", "--ddp"], "drop --ddp"),
        (["--world-size", "4", "--replicate", "2", "--ddp"], "drop --ddp"),
        (["--world-size", "4", "--tp", "3"], "tensor_parallel must be a positive divisor"),
    ],
)
def test_report_tp_mistakes_are_one_line(capsys, argv, message):
    assert main(["report", "--model", "mlp", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_report_pp_prints_one_row_per_stage_from_measure_pipeline(capsys):
    """``--pp 2 --world-size 2``: per-stage rows of torch's 1F1B schedule on the zoo MLP, equal to
    measure_pipeline with the same spec; pipeline mistakes are one line."""
    from memsave_nb.parallel import measure_pipeline

    assert (
        main(["report", "--model", "mlp", "--batch", "16", "--pp", "2", "--world-size", "2", "--schedule", "gpipe"])
        == 0
    )
    out = capsys.readouterr().out
    wl = zoo.make("mlp", 16)
    expected = measure_pipeline(
        wl,
        ParallelSpec(world_size=2, pipeline_parallel=2, schedule="gpipe", microbatches=4),
        loss_fn=torch.nn.functional.cross_entropy,
        target=wl.loss.targets,
    )
    assert "PP 2 (GPipe, 4 micro-batches)" in out.splitlines()[0]
    assert expected.table() in out and "0 (stage 0)" in out and "1 (stage 1)" in out
    assert not dist.is_initialized()
    for argv, message in [
        (["--world-size", "2", "--microbatches", "4"], "--schedule and --microbatches need --pp P"),
        (["--world-size", "2", "--pp", "2", "--ddp"], "--pp is measured alone or with FSDP2"),
        (["--world-size", "2", "--pp", "2", "--microbatches", "5"], "microbatches 5 must divide the batch size 16"),
    ]:
        assert main(["report", "--model", "mlp", "--batch", "16", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_report_tp_sequence_parallel_on_a_hub_model_by_name(capsys):
    """``report --model llama-3.2-1b --tp 2 --sequence-parallel``: the catalogue's Llama 3.2 1B
    (built on meta from its config) sized per rank with sequence parallel, the numbers of
    measure_parallel on the same workload. Refused before (the Llama's forward did not run on
    sequence shards)."""
    from memsave_nb.hub import from_pretrained

    argv = [
        "report",
        "--model",
        "llama-3.2-1b",
        "--seq-len",
        "64",
        "--world-size",
        "2",
        "--tp",
        "2",
        "--sequence-parallel",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "TP 2 (2 ranks, mesh 1x2, sequence parallel)" in out.splitlines()[0]
    spec = ParallelSpec(world_size=2, tensor_parallel=2, sequence_parallel=True)
    expected = measure_parallel(from_pretrained("llama-3.2-1b", batch_size=1, seq_len=64), spec)
    assert expected.table() in out
    assert not dist.is_initialized()


def test_report_reshard_root_sizes_accelerates_root_and_says_so(capsys):
    """``--reshard-root``: the root resharded after forward as accelerate does (issue 40); the
    default keeps it gathered, torch's default."""
    argv = ["report", "--model", "mlp", "--batch", "8", "--world-size", "2"]
    assert main([*argv, "--reshard-root"]) == 0
    out = capsys.readouterr().out
    assert "root resharded after forward" in out.splitlines()[0]
    assert measure_parallel(zoo.make("mlp", 8), ParallelSpec(world_size=2, reshard_root=True)).table() in out
    assert main(argv) == 0
    assert "root" not in capsys.readouterr().out.splitlines()[0]
    assert main([*argv, "--reshard-root", "--ddp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reshard-root is FSDP2's" in err
