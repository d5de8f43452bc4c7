"""Tensor parallel on a peft LoRA model (issue 38): the default plan splits each wrapped linear's
base layer as the plain plan would, and lora_B (column-wise) or lora_A (row-wise) with it.

Oracles: the analytic per-rank shapes; on real gloo ranks each rank's loss equals the unsplit
model's and its tracked peak equals the fake-mode prediction (as test_tp.py's gloo check)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from memsave_nb.parallel import ParallelError, ParallelSpec, measure_parallel
from memsave_nb.parallel.tp import tp_local_shapes

from .test_tp import llama

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R = 4


def lora_llama():
    peft = pytest.importorskip("peft")
    wl = llama(kv_heads=2)
    torch.manual_seed(1)
    model = peft.get_peft_model(wl.model, peft.LoraConfig(r=R, target_modules=TARGETS, init_lora_weights=False))
    return wl.replace(model=model)


def test_each_rank_holds_the_base_and_lora_shards_of_the_plain_plan():
    wl = lora_llama()
    shapes = tp_local_shapes(wl.model, ParallelSpec(world_size=2, tensor_parallel=2))
    layer = "base_model.model.model.layers.0."
    # hidden 64, 4 heads of 16, 2 KV heads (k/v 32 wide), MLP 128, r 4
    assert shapes[layer + "self_attn.q_proj.base_layer.weight"] == (32, 64)
    assert shapes[layer + "self_attn.q_proj.lora_A.default.weight"] == (R, 64)  # whole input: replicated
    assert shapes[layer + "self_attn.q_proj.lora_B.default.weight"] == (32, R)  # the outputs this rank makes
    assert shapes[layer + "self_attn.k_proj.lora_B.default.weight"] == (16, R)
    assert shapes[layer + "self_attn.o_proj.base_layer.weight"] == (64, 32)
    assert shapes[layer + "self_attn.o_proj.lora_A.default.weight"] == (R, 32)  # the inputs this rank holds
    assert shapes[layer + "self_attn.o_proj.lora_B.default.weight"] == (64, R)
    assert shapes[layer + "mlp.down_proj.lora_A.default.weight"] == (R, 64)
    assert shapes[layer + "mlp.up_proj.lora_B.default.weight"] == (64, R)


def test_tp_on_a_lora_model_is_sized_and_sequence_parallel_refused_in_one_line():
    wl = lora_llama()
    assert measure_parallel(wl, ParallelSpec(world_size=4, tensor_parallel=2)).worst.peak_bytes > 0
    with pytest.raises(ParallelError) as err:
        measure_parallel(wl, ParallelSpec(world_size=2, tensor_parallel=2, sequence_parallel=True))
    assert str(err.value).startswith("sequence_parallel with LoRA layers") and len(str(err.value)) <= 200


def _rank(rank: int, spec_dict: dict, store: str, out: str) -> None:
    from memsave_nb.parallel.process_group import settle_forked_rank

    settle_forked_rank()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memsave_nb.parallel.apply import apply_parallel
    from memsave_nb.parallel.step import tracked_step
    from memsave_nb.parallel.tp import clear_dtensor_caches

    clear_dtensor_caches()
    torch.set_num_threads(1)
    spec = ParallelSpec.from_dict(spec_dict)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=spec.world_size)
    try:
        wl = lora_llama()
        called = apply_parallel(
            wl.model, spec, init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names)
        )
        with torch.no_grad():
            loss = wl.compute_loss(wl.replace(model=called).forward(wl.make_batch())).item()
        r = tracked_step(wl, called, wl.make_batch(), rank=rank, ranks=(rank,), steady="full")
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"loss": loss, "peak": r.peak_bytes}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo backend not built")
def test_real_gloo_tp_ranks_compute_the_unsplit_loss_and_peak_as_sized():
    import torch.multiprocessing as mp

    spec = ParallelSpec(world_size=2, tensor_parallel=2)
    predicted = measure_parallel(lora_llama(), spec).worst.peak_bytes
    ref = lora_llama()
    with torch.no_grad():
        whole = ref.compute_loss(ref.forward(ref.make_batch())).item()
    runs = []
    for _attempt in range(3):  # gloo's worker thread can free a buffer late (test_tp.py)
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _rank, args=(spec.to_dict(), os.path.join(tmp, "store"), tmp), nprocs=2, start_method="fork"
            )
            ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2)]
        assert [r["loss"] for r in ranks] == pytest.approx([whole] * 2, rel=1e-5)
        runs.append([r["peak"] for r in ranks])
        if runs[-1] == [predicted] * 2:
            return
    raise AssertionError(f"no exact run in 3: {runs}, predicted {predicted}")


def test_pipeline_stages_of_a_lora_model_compute_its_logits():
    """The layout search split PeftModels into no stages ("neither ... nor a Hugging Face decoder"):
    the stages are now the decoder's inside it, LoRA layers included."""
    from memsave_nb.parallel import split_stages
    from memsave_nb.planner.pp import splittable

    wl = lora_llama()
    assert splittable(wl.model)
    stages = split_stages(wl.model, 2)
    ids = wl.batch["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](ids)), wl.model(input_ids=ids).logits)
    lora = {id(p) for n, p in wl.model.named_parameters() if "lora_" in n}
    assert lora <= {id(p) for s in stages for p in s.parameters()}


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo backend not built")
def test_lora_model_on_two_real_stage_ranks_measures_what_fake_mode_predicts():
    from memsave_nb.parallel import cross_check, measure_pipeline

    spec = ParallelSpec(world_size=2, pipeline_parallel=2, microbatches=2)
    predicted = measure_pipeline(lora_llama(), spec)
    rows = cross_check(lora_llama, spec)
    assert [r.predicted_bytes for r in rows] == [r.peak_bytes for r in predicted.ranks]
    assert [r.difference_bytes for r in rows] == [0, 0], [(r.rank, r.predicted_bytes, r.comparable_bytes) for r in rows]


@pytest.mark.slow
def test_the_issues_qwen_lora_at_tp2_x_fsdp2_2_is_sized():
    """Issue 38's call: a raw RuntimeError before; 1,262,767,880 B per rank here (fake mode, about
    4 s of CPU), the LoRA matrices split as the plain plan's shapes say. (2,048 B more than before
    the synthetic batch's labels became their own 1 x 256 int64 tensor, as a collator makes them;
    384 B more since each rank runs the attention CUDA picks for a model by name, cuDNN on an H100:
    its philox seed and offset, two int64 scalars per layer, 24 x 16 B, saved beside the CPU
    kernel's output and logsumexp.)"""
    from memsave_nb.hub import from_pretrained

    pytest.importorskip("peft")
    wl = from_pretrained("qwen2.5-0.5b", lora=dict(r=8), seq_len=256)
    spec = ParallelSpec(world_size=4, tensor_parallel=2)
    shapes = tp_local_shapes(wl.model, spec)
    q = next(n for n in shapes if n.endswith("layers.0.self_attn.q_proj.lora_B.default.weight"))
    assert shapes[q] == (896 // 2, 8)
    assert measure_parallel(wl, spec).device_peak_bytes == 1_262_767_880


def test_to_code_splits_a_lora_model_like_the_prediction():
    """The exported plan functions (tp_plan.py's source) split the LoRA layers as sized: exec'd on a
    fresh LoRA Llama on a fake group, rank 0's step on real CPU tensors equals the prediction."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from memsave_nb import Plan
    from memsave_nb.parallel.step import tracked_step

    plan = Plan(parallel=ParallelSpec(world_size=4, tensor_parallel=2))
    predicted = measure_parallel(lora_llama(), plan=plan, ranks=[0]).rank(0)
    fresh = lora_llama()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        ns = {"model": fresh.model}
        exec(compile(plan.to_code(), "<plan>", "exec"), ns)
        q = ns["model"].base_model.model.model.layers[0].self_attn.q_proj
        assert type(q.base_layer.weight).__name__ == type(q.lora_B.default.weight).__name__ == "DTensor"
        measured = tracked_step(fresh, ns["model"], fresh.make_batch(), rank=0, ranks=(0,), steady="full")
    finally:
        dist.destroy_process_group()
    assert measured.peak_bytes == predicted.peak_bytes
