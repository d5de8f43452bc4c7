"""A tiny Llama-shaped model from a config (random weights, nothing downloaded) for the trainer tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 64, 4


def tiny_llama(layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture
def llama() -> torch.nn.Module:
    return tiny_llama()
