"""``Plan.to_code()`` for every loss but the model's own: the exported code names the loss and the
trainer setting it stands for, and its snippet, run on a fresh copy of the model, measures the
plan's peak (the plan applied by memsave_nb is the oracle)."""

from __future__ import annotations

import copy

import pytest
import torch

from memsave_nb import Plan, Workload, measure
from memsave_nb.vocabulary import LOSSES

# what the user must set in their trainer for each loss
SETTING = {
    "trl_cpu": ["SFTConfig(loss_type='nll', use_cpu=True)", "use_trl_head(model, cuda=False, smoothing=0.0)"],
    "trl_cuda": ["SFTConfig(loss_type='nll')", "use_trl_head(model, cuda=True, smoothing=0.0)"],
    "trl_smooth_cpu": [
        "SFTConfig(loss_type='nll', label_smoothing_factor=0.1, use_cpu=True)",
        "use_trl_head(model, cuda=False, smoothing=0.1)",
    ],
    "trl_smooth_cuda": [
        "SFTConfig(loss_type='nll', label_smoothing_factor=0.1)",
        "use_trl_head(model, cuda=True, smoothing=0.1)",
    ],
    "hf_smooth": ["TrainingArguments(label_smoothing_factor=0.1)", "use_label_smoother(model, epsilon=0.1)"],
}


def test_every_registered_loss_has_its_setting_here():
    assert set(SETTING) == set(LOSSES) - {"full", "chunked"}


@pytest.mark.parametrize("loss", sorted(SETTING))
def test_exported_code_names_the_loss_and_its_trainer_setting(loss):
    plan = Plan(loss=loss)
    code = plan.to_code()
    assert f"loss {loss!r}" in code
    for words in SETTING[loss]:
        assert words in code
    assert f"loss {loss}" in plan.describe()  # the header names it too, not "baseline (no changes)"


def _llama() -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=211,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 211, (2, 24))
    return Workload(LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}, name="llama-tiny")


@pytest.mark.parametrize("loss", sorted(SETTING))
def test_snippet_reproduces_the_measured_peak(loss):
    wl = _llama()
    plan = Plan(loss=loss)
    with plan.apply(wl) as w:
        planned = measure(w, mode="fake", repeats=0, flops=False).peak_bytes
    fresh = copy.deepcopy(wl.model)
    scope: dict = {"model": fresh}
    exec(compile(plan.to_code(), "<plan>", "exec", dont_inherit=True), scope)
    snippet = measure(Workload(fresh, wl.batch), mode="fake", repeats=0, flops=False)
    assert snippet.peak_bytes == planned
