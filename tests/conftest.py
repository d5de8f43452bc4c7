"""Fixtures shared across the test rooms."""

from __future__ import annotations

import json

import pytest

# A Llama two layers deep, small enough that the CLI sizes it in a second, as a hub folder would hold it.
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture()
def tiny(tmp_path):
    """A model folder holding only TINY_LLAMA's ``config.json``, as ``--model`` takes it."""
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path.parent)


@pytest.fixture(scope="session")
def tiny_session(tmp_path_factory):
    """TINY_LLAMA's model folder once per session (for hypothesis tests, which refuse per-test fixtures)."""
    path = tmp_path_factory.mktemp("tiny-llama") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path.parent)
