"""'Only config.json is ever read': a config naming an attention kernel (a hub repository, or
flash_attention_2, which transformers swaps for a hub kernel when flash-attn is missing) never
reaches transformers' kernel loaders; the model is built with transformers' default (sdpa)."""

from __future__ import annotations

import json

import pytest

from memsave_nb.hub import from_pretrained

TINY = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128),
    "llama": dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=128,
    ),
}


@pytest.fixture
def loader_calls(monkeypatch):
    """Every entry point that loads an attention kernel, replaced by a spy that records and refuses."""
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.modeling_flash_attention_utils as fa_utils
    import transformers.modeling_utils as modeling_utils

    calls = []

    def spy(name):
        def refuse(*args, **kwargs):
            calls.append((name, args[:1]))
            raise RuntimeError(f"kernel loader {name} reached")

        return refuse

    for module, name in [
        (modeling_utils, "lazy_import_flash_attention"),
        (fa_utils, "lazy_import_flash_attention"),
        (hub_kernels, "load_and_register_attn_kernel"),
        (hub_kernels, "lazy_load_kernel"),
        (hub_kernels, "get_kernel"),
    ]:
        monkeypatch.setattr(module, name, spy(name))
    return calls


@pytest.mark.parametrize(
    "attn", ["some-org/some-kernel", "kernels-community/flash-attn3", "flash_attention_2", "paged|flash_attention_2"]
)
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
@pytest.mark.parametrize("key", ["attn_implementation", "_attn_implementation"])
def test_a_config_naming_a_kernel_builds_with_sdpa_and_loads_nothing(tmp_path, loader_calls, attn, model_type, key):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, key: attn, **TINY[model_type]}))
    wl = from_pretrained(str(path), lora="r=4")
    assert loader_calls == []
    assert wl.model.config._attn_implementation == "sdpa"
    attns = {
        getattr(m, "config", wl.model.config)._attn_implementation for m in wl.model.modules() if hasattr(m, "config")
    }
    assert attns == {"sdpa"}


def test_a_config_object_naming_a_kernel_is_not_followed_nor_changed(loader_calls):
    from transformers import LlamaConfig

    mine = LlamaConfig(**TINY["llama"], attn_implementation="some-org/some-kernel")
    wl = from_pretrained(mine)
    assert loader_calls == [] and wl.model.config._attn_implementation == "sdpa"
    assert mine._attn_implementation == "some-org/some-kernel"  # the caller's config is left as it was


def test_the_spies_do_catch_a_kernel_request(loader_calls):
    """The oracle can fail: transformers itself, asked for the kernel, reaches the spied loader."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import torch

    with torch.device("meta"), pytest.raises(RuntimeError, match="kernel loader"):
        AutoModelForCausalLM.from_config(LlamaConfig(**TINY["llama"]), attn_implementation="some-org/some-kernel")
    assert loader_calls and loader_calls[0][0] == "lazy_import_flash_attention"


def test_kernels_named_inside_sub_configs_are_not_followed_either(tmp_path, loader_calls):
    """A multimodal config (Gemma 3: a text and a vision tower) naming kernels in each sub-config."""
    kernel = {"attn_implementation": "some-org/some-kernel", "_attn_implementation": "some-org/some-kernel"}
    text = dict(TINY["llama"], head_dim=16, **kernel)
    vision = dict(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        **kernel,
    )
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "gemma3", "text_config": text, "vision_config": vision, "mm_tokens_per_image": 4, **kernel}
        )
    )
    wl = from_pretrained(str(tmp_path), task="causal-lm")
    assert loader_calls == []
    configs = [m.config for m in wl.model.modules() if hasattr(m, "config")]
    assert len({type(c).__name__ for c in configs}) >= 3  # the model's, the text tower's, the vision tower's
    assert {c._attn_implementation for c in configs} == {"sdpa"}
