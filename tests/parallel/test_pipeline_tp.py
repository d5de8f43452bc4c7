"""Pipeline stages with tensor parallel and with HSDP (a 3-D mesh (pp, shard, tp) or (pp,
replicate, shard)), per rank in fake mode on torch's own PipelineStage, Schedule1F1B,
parallelize_module and fully_shard, against a real gloo run at world size 4 (PP 2 x TP 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memsave_nb.parallel import ParallelSpec, cross_check, measure_pipeline
from memsave_nb.workload import Workload
from memsave_nb.zoo import GPT, GPTConfig

N_EMBD, VOCAB, BLOCK, LAYERS = 64, 256, 32, 4


def gpt() -> Workload:
    cfg = GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=4, n_embd=N_EMBD, dropout=0.0)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, VOCAB, (4, BLOCK))
    return Workload(model, {"idx": idx, "targets": idx}, name="gpt-pp-tp")


def _local_stage_params(first: bool, tp: int = 2) -> int:
    """Parameter elements one TP rank holds of a stage of two blocks (by hand, the zoo GPT's shapes):
    qkv and mlp.fc column-wise (weight and bias split), attn.proj and mlp.proj row-wise (weight
    split, bias replicated), the LayerNorms replicated; the first stage's wte row-wise over the
    vocabulary and wpe replicated, the last stage's head column-wise and ln_f replicated."""
    c = N_EMBD
    split = 3 * c * c + 3 * c + c * c + 4 * c * c + 4 * c + 4 * c * c
    replicated = 2 * 2 * c + 2 * c
    blocks = 2 * (split // tp + replicated)
    return blocks + (VOCAB * c // tp + BLOCK * c if first else VOCAB * c // tp + 2 * c)


def test_pp2_x_tp2_runs_in_fake_mode_and_each_rank_holds_its_stage_split_over_tp():
    spec = ParallelSpec(world_size=4, pipeline_parallel=2, tensor_parallel=2, microbatches=2)
    assert (spec.mesh_shape, spec.mesh_dim_names) == ((2, 1, 2), ("pp", "shard", "tp"))
    assert spec.describe() == "PP 2 x TP 2 (1F1B, 2 micro-batches)"
    m = measure_pipeline(gpt(), spec)
    assert [r.ranks for r in m.ranks] == [(0, 1), (2, 3)]
    for r, first in zip(m.ranks, (True, False)):
        assert r.peak_split["sharded_parameters"] == 4 * _local_stage_params(first), r.rank
    assert not dist.is_initialized()


@pytest.mark.parametrize("kw", [dict(tensor_parallel=2), dict(replicate=2)], ids=["pp-tp-fsdp", "pp-hsdp"])
def test_three_d_meshes_with_pipeline_stages_run_in_fake_mode(kw):
    spec = ParallelSpec(world_size=8, pipeline_parallel=2, microbatches=2, **kw)
    assert len(spec.mesh_shape) == 3 and spec.mesh_dim_names[0] == "pp"
    m = measure_pipeline(gpt(), spec)
    assert [r.ranks for r in m.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for r, first in zip(m.ranks, (True, False)):
        if "tensor_parallel" in kw:  # FSDP2 over 2 shards the TP shard of every parameter on dim 0 (all even here)
            assert r.peak_split["sharded_parameters"] == 4 * _local_stage_params(first) // 2, r.rank
        else:  # HSDP: replicated twice, sharded over 2
            assert r.peak_split["sharded_parameters"] == 4 * _local_stage_params(first, tp=1) // 2, r.rank
    assert not dist.is_initialized()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_pp2_x_tp2_on_four_real_gloo_ranks_measures_what_fake_mode_predicts():
    """Every rank to the byte, split included (each rank exact in one of three runs: gloo's worker
    thread may free a buffer late, never early)."""
    spec = ParallelSpec(world_size=4, pipeline_parallel=2, tensor_parallel=2, microbatches=2)
    exact: set[int] = set()
    for _ in range(3):
        rows = cross_check(gpt, spec)
        assert all(r.difference_bytes >= 0 for r in rows), [(r.rank, r.difference_bytes) for r in rows]
        exact |= {r.rank for r in rows if r.difference_bytes == 0 and r.predicted_split == r.measured_split}
        if exact == {0, 1, 2, 3}:
            break
    assert exact == {0, 1, 2, 3}


def test_report_pp_with_tp_prints_each_stage_of_the_3d_mesh(capsys):
    from memsave_nb.cli import main

    assert main(["report", "--model", "gpt", "--pp", "2", "--tp", "2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "PP 2 x TP 2 (1F1B, 4 micro-batches)" in out
    assert "0-1 (stage 0)" in out and "2-3 (stage 1)" in out
    assert not dist.is_initialized()


def test_pp_x_tp_says_the_head_count_does_not_divide():
    """Issue 38: a pipeline stage of a Hugging Face decoder holds layers, not the model with its
    config, so the head check saw no heads and the step failed inside torch's pipeline instead."""
    from memsave_nb.parallel import ParallelError

    from .test_tp import llama

    with pytest.raises(ParallelError) as err:
        measure_pipeline(
            llama(kv_heads=2), ParallelSpec(world_size=8, pipeline_parallel=2, tensor_parallel=4, microbatches=2)
        )
    assert str(err.value) == "tensor_parallel 4 does not divide num_key_value_heads (2): each rank holds whole heads"
    assert not dist.is_initialized()
