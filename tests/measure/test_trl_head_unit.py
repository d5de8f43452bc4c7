"""TRL's fused LM head (``memsave_nb/loss_trl.py``) against TRL 1.16's own, run here.

The oracle is TRL's ``add_fused_lm_head`` on the same tiny model (vocabulary 40,000: two vocabulary
tiles of at most 32,768) followed by what ``SFTTrainer.compute_loss`` does with its output; the
allocator records both steps. The CPU path must allocate exactly what TRL's does and give the
same loss and gradients; the CUDA path (Triton, not on this machine) is checked by its
allocations as read from ``trl/kernels/chunked_logprob.py``.
"""

from __future__ import annotations

import pytest
import torch

from measure.allocator_oracle import allocator_peak  # tests/ is on sys.path (rootdir-relative packages)
from memsave_nb import Plan, Workload, measure
from memsave_nb.checkpointing import PlanError
from memsave_nb.loss_trl import TOKEN_TILE, VOCAB_TILE, use_trl_head

transformers = pytest.importorskip("transformers")

B, T, VOCAB, H = 2, 8, 40_000, 16
N = B * (T - 1)


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt: ignored positions
    return {"input_ids": ids, "labels": labels}


def _step(model, call):
    def step():
        loss = call(model)
        loss.backward()
        step.loss = loss.detach()

    return step


def _trl_loss(model):
    """SFTTrainer.compute_loss on TRL's fused output (loss_type='nll'), its metrics included."""
    out = model(**_batch(), fused_lm_head=True)
    loss = (-out.log_probs).sum() / torch.as_tensor(out.label_mask.sum()).clamp(min=1)
    valid = out.label_mask.sum()
    (out.entropy.detach().sum() / valid).item(), (out.is_top1.sum() / valid).item()
    return loss


def test_cpu_path_allocates_what_trls_head_allocates_and_computes_the_same():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    theirs_model = tiny()
    trl_utils.add_fused_lm_head(theirs_model, outputs=("log_probs", "entropy", "is_top1"))
    ours_model = tiny()
    undo = use_trl_head(ours_model, cuda=False)
    theirs_step, ours_step = _step(theirs_model, _trl_loss), _step(ours_model, lambda m: m(**_batch()).loss)
    theirs = allocator_peak(theirs_step, theirs_model.parameters())
    ours = allocator_peak(ours_step, ours_model.parameters())
    # the head's tile buffer and its temporaries: over 2 MB of a 5 MB step, to the byte
    assert ours.rise_bytes == theirs.rise_bytes and theirs.rise_bytes > N * VOCAB_TILE * 4
    torch.testing.assert_close(ours_step.loss, theirs_step.loss)
    for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    undo()
    assert "forward" not in ours_model.__dict__


def test_cuda_path_holds_the_tile_and_per_token_vectors_only():
    """Triton folds the tiles in place: the head's backward holds the tile buffer, fp32 gradient
    accumulators for the kept rows and the head weight, and no tokens x vocabulary temporaries
    (the CPU path holds eight float32 ones and a bool one at once; seen: 12.59 MB more than the
    CUDA path here, 6.9 of them). The loss and gradients are the CPU path's."""
    steps = {}
    for cuda in (False, True):
        model = tiny()
        use_trl_head(model, cuda=cuda)
        step = _step(model, lambda m: m(**_batch()).loss)
        steps[cuda] = (allocator_peak(step, model.parameters()).rise_bytes, step.loss, model.lm_head.weight.grad)
    (cpu, cpu_loss, cpu_grad), (gpu, gpu_loss, gpu_grad) = steps[False], steps[True]
    torch.testing.assert_close(gpu_loss, cpu_loss)
    torch.testing.assert_close(gpu_grad, cpu_grad)
    widest = min(VOCAB, VOCAB_TILE)
    assert cpu - gpu >= 6 * N * widest * 4
    kept = N - 3
    assert gpu < min(kept, TOKEN_TILE) * VOCAB_TILE * 4 + 2 * VOCAB * H * 4 + 200_000


@pytest.mark.parametrize("loss", ["trl_cpu", "trl_cuda", "trl_smooth_cpu"])
def test_fake_mode_measures_what_the_real_step_measures(loss):
    plan = Plan(loss=loss, optimizer="adamw")
    real = fake = None
    for mode in ("real", "fake"):
        with plan.apply(Workload(tiny(), batch=_batch(), loop="loss_only")) as w:
            peak = measure(w, mode=mode, repeats=0, flops=False).peak_bytes
        real, fake = (peak, fake) if mode == "real" else (real, peak)
    assert fake == pytest.approx(real, abs=512)


def test_bad_input_is_one_line_and_the_model_is_left_as_it_was():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(PlanError, match="Hugging Face") as e:
        use_trl_head(model, cuda=False)
    assert "\n" not in str(e.value) and len(str(e.value)) <= 200
    assert "forward" not in model.__dict__
    with pytest.raises(PlanError, match="leave Workload.loss unset"):
        with Plan(loss="trl_cpu").apply(Workload(tiny(), batch=_batch(), loss=lambda out, b: out.logits.sum())):
            pass
