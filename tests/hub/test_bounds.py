"""The cost estimate that refuses absurd configs before building: above every real model's
parameter count and not far above it (so the bounds mean what they say), and fast."""

from __future__ import annotations

import time

import pytest

from memsave_nb.hub import from_pretrained, resolve_config
from memsave_nb.hub.bounds import MAX_LAYERS, check_config


@pytest.mark.parametrize(
    "name", ["gpt2", "bert-base", "t5-base", "vit-b/16", "qwen3-8b", "llama-3.1-70b", "gemma-2-27b"]
)
def test_the_estimate_is_between_1_and_1_6_times_the_built_parameter_count(name):
    estimate = check_config(resolve_config(name), 2, True)
    built = sum(p.numel() for p in from_pretrained(name).model.parameters())
    assert built <= estimate <= 1.6 * built, (estimate, built)


def test_the_deepest_config_allowed_builds_in_seconds_and_one_more_layer_is_refused():
    tiny = dict(n_embd=32, n_head=4, vocab_size=100, n_positions=64)
    start = time.perf_counter()
    wl = from_pretrained("gpt2", overrides=dict(tiny, n_layer=MAX_LAYERS))
    assert time.perf_counter() - start < 20  # 1.4 s here; 10**6 layers gave no answer in 240 s
    assert len(wl.model.transformer.h) == MAX_LAYERS
    from memsave_nb import MemsaveError

    with pytest.raises(
        MemsaveError, match=f"config has {MAX_LAYERS + 1:,} layers; models by name are built up to {MAX_LAYERS:,}"
    ):
        from_pretrained("gpt2", overrides=dict(tiny, n_layer=MAX_LAYERS + 1))
