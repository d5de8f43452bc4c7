"""Pipeline stages of a Hugging Face decoder (parallel/stages.py ``HFDecoderStage``): a Llama-shaped
model splits its layers evenly, the embedding on the first stage, norm and head on the last, the
causal-LM loss per micro-batch; fake-mode sizing against real 2-stage gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from memsave_nb.parallel import ParallelSpec, cross_check, measure_pipeline, split_stages
from memsave_nb.parallel.stages import HFDecoderStage
from memsave_nb.workload import Workload

transformers = pytest.importorskip("transformers")


def llama() -> Workload:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (4, 16))
    return Workload(model, {"input_ids": ids, "labels": ids}, name="llama-pp")


def test_stages_of_a_hf_decoder_compute_the_models_logits_and_loss():
    wl = llama()
    stages = split_stages(wl.model, 2)
    assert all(isinstance(s, HFDecoderStage) for s in stages)
    assert [len(s.layers) for s in stages] == [2, 2] and stages[0].first and stages[1].last
    ids = wl.batch["input_ids"]
    with torch.no_grad():
        whole = wl.model(input_ids=ids, labels=ids)
        logits = stages[1](stages[0](ids))
    torch.testing.assert_close(logits, whole.logits)
    from memsave_nb.parallel.stages import _causal_lm_loss

    torch.testing.assert_close(_causal_lm_loss(logits, ids), whole.loss)


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_hf_decoder_on_two_real_stage_ranks_measures_what_fake_mode_predicts():
    spec = ParallelSpec(world_size=2, pipeline_parallel=2, schedule="1f1b", microbatches=2)
    predicted = measure_pipeline(llama(), spec)
    rows = cross_check(llama, spec)
    assert [r.predicted_bytes for r in rows] == [r.peak_bytes for r in predicted.ranks]
    assert [r.difference_bytes for r in rows] == [0, 0], [(r.rank, r.predicted_bytes, r.comparable_bytes) for r in rows]
