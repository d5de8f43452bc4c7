"""Fixtures shared across the test rooms."""

from __future__ import annotations

import json
import sys

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


@pytest.fixture(autouse=True)
def _bitsandbytes_overrides_die_with_their_test():
    """bitsandbytes' ``GlobalOptimManager`` is one per process and keeps every override a Trainer
    registers (``create_optimizer``: ``nn.Embedding`` weights at 32 bits), keyed by parameter index:
    any later 8-bit optimizer at those indices took them (tests/measure/test_optimizers_extra failed
    after tests/trainers/test_embed32). Cleared after each test that left some."""
    yield
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return
    manager = bnb.optim.GlobalOptimManager.get_instance()
    if manager.pid2config or manager.index2config or manager.module_weight_config_triple:
        manager.initialize()
