"""Every kind of name, offline: catalogue, local folder, config.json, PretrainedConfig, hub id
(answered from a hub cache pointed at a local folder); the published parameter counts as oracle."""

from __future__ import annotations

import json

import pytest
import torch

import memsave_nb
from memsave_nb.hub import catalogue, catalogue_names, from_pretrained, resolve_config

# published parameter counts (model cards / safetensors metadata), tied embeddings once
PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-0.5b": 494_032_768,
    "gpt2": 124_439_808,
    "mistral-7b": 7_248_023_552,
}


def n_params(wl) -> int:
    return sum(p.numel() for p in wl.model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_catalogue_models_have_their_published_parameter_counts(name):
    wl = from_pretrained(name)
    assert n_params(wl) == PUBLISHED[name]
    assert all(p.device.type == "meta" for p in wl.model.parameters())  # nothing allocated
    assert all(p.dtype == torch.bfloat16 for p in wl.model.parameters())


def test_every_catalogue_entry_names_its_source_and_builds():
    import transformers

    for name in catalogue_names():
        entry = catalogue()[name]
        assert "/" in entry["source"], name
        if entry["model_type"] == "qwen3" and not hasattr(transformers, "Qwen3Config"):
            continue
        cfg = resolve_config(name)
        assert cfg.name_or_path == entry["source"]


def test_batch_has_the_task_shapes():
    wl = from_pretrained("llama-3.2-1b", batch_size=3, seq_len=128)
    batch = wl.make_batch()
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 128)
    assert wl.batch.resized(batch_size=5)()["input_ids"].shape == (5, 128)  # another size, same model
    vit = from_pretrained("vit-b/16", batch_size=2, dtype="fp32")
    assert type(vit.model).__name__ == "ViTForImageClassification"
    assert vit.make_batch()["pixel_values"].shape == (2, 3, 224, 224)
    t5 = from_pretrained("t5-base", seq_len=64)
    assert type(t5.model).__name__ == "T5ForConditionalGeneration"
    bert = from_pretrained("bert-base", task="seq-classification", batch_size=4, seq_len=32)
    assert bert.make_batch()["labels"].shape == (4,)


def _small_config_json(path, model_type="llama"):
    data = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    path.write_text(json.dumps(data))
    return data


def test_local_folder_and_config_json(tmp_path):
    _small_config_json(tmp_path / "config.json")
    by_folder = from_pretrained(str(tmp_path), seq_len=16)
    by_file = from_pretrained(tmp_path / "config.json", seq_len=16)
    assert type(by_folder.model).__name__ == "LlamaForCausalLM"
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 kv heads of 16); MLP; 2 norms
    assert n_params(by_folder) == n_params(by_file) == 2 * 1000 * 64 + 2 * per_layer + 64  # embed + untied head


def test_config_object_is_used_and_left_as_it_was():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    before = cfg.to_dict()
    wl = from_pretrained(cfg, seq_len=16, overrides={"num_hidden_layers": 1}, task="seq-classification")
    assert cfg.to_dict() == before
    assert wl.model.config.num_hidden_layers == 1
    assert type(wl.model).__name__ == "LlamaForSequenceClassification"


def test_hub_id_from_the_cache_without_network(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    snapshot = tmp_path / "models--someorg--tiny-llama" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    _small_config_json(snapshot / "config.json")
    (tmp_path / "models--someorg--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--someorg--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    wl = memsave_nb.from_pretrained("someorg/tiny-llama", seq_len=16)
    assert wl.model.config.hidden_size == 64 and wl.name == "someorg/tiny-llama"
    assert type(wl.model).__name__ == "LlamaForCausalLM"


def test_labels_are_their_own_tensor_as_a_collator_makes_them():
    """DataCollatorForLanguageModeling clones input_ids into labels: two int64 tensors, not one
    (the batch counted 512 B here when labels were input_ids itself; 1,024 B now)."""
    from memsave_nb import measure

    small = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    )
    wl = from_pretrained("llama-3.2-1b", overrides=small, batch_size=2, seq_len=32)
    batch = wl.make_batch()
    assert batch["labels"].untyped_storage().data_ptr() != batch["input_ids"].untyped_storage().data_ptr()
    torch.testing.assert_close(batch["labels"], batch["input_ids"])
    m = measure(wl, mode="fake")
    assert m.peak_split.inputs == m.end_of_forward.inputs == 2 * (2 * 32 * 8)  # input_ids + labels, int64
