"""``Plan(precision="fp32")`` on a bf16 model holds fp32 parameters, as the plan says, and undo
gives the bf16 ones back (issue 40 part 2: a bf16 hub model once kept bf16 silently)."""

from __future__ import annotations

import torch

from memsave_nb import Plan, measure
from memsave_nb.hub import from_pretrained

SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    seq_len=64,
)


def test_fp32_casts_a_bf16_model_and_undo_restores_it():
    wl = from_pretrained("qwen2.5-0.5b", dtype=torch.bfloat16, **SMALL)
    params = list(wl.model.parameters())
    n_bytes = sum(p.numel() for p in params)
    with Plan(precision="fp32").apply(wl) as applied:
        assert {p.dtype for p in applied.model.parameters()} == {torch.float32}
        fp32 = measure(applied, mode="fake")
    assert list(wl.model.parameters()) == params and {p.dtype for p in params} == {torch.bfloat16}
    bf16 = measure(wl, mode="fake")
    assert fp32.peak_split.gradients == 4 * n_bytes == 2 * bf16.peak_split.gradients
    for precision in ("autocast_bf16", "autocast_fp16"):
        with Plan(precision=precision).apply(wl) as applied:
            assert {p.dtype for p in applied.model.parameters()} == {torch.float32}
    assert {p.dtype for p in wl.model.parameters()} == {torch.bfloat16}
