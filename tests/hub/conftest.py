"""Shared small shapes for the hub tests: catalogue architectures at test size (same code path)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

# per catalogue model: config fields that shrink it (fewer layers, narrower, a small vocabulary)
SMALL = {
    "llama-3.2-1b": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    ),
    "qwen2.5-0.5b": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    ),
    "t5-base": dict(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16, num_heads=4, vocab_size=1000),
}
