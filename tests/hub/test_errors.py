"""Every user mistake is one line (a MemsaveError) that says what to do."""

from __future__ import annotations

import json

import pytest

from memsave_nb import MemsaveError
from memsave_nb.hub import from_pretrained, parse_lora


def one_line_error(match: str, *args, **kwargs) -> str:
    with pytest.raises(MemsaveError, match=match) as info:
        from_pretrained(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_name_lists_the_closest_catalogue_names():
    message = one_line_error("unknown model 'lama-3.1-8b'", "lama-3.1-8b")
    assert "llama-3.1-8b" in message


def test_hub_id_without_network_or_local_copy(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = one_line_error("no network and no local copy", "Qwen/Qwen2.5-7B-Instruct")
    assert "local folder or config.json" in message and "qwen2.5-7b" in message


def test_config_class_this_transformers_does_not_know(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama99", "hidden_size": 8}))
    message = one_line_error("does not know the config class 'llama99'", str(tmp_path))
    assert "upgrade transformers" in message


def test_config_class_error_says_which_release_added_it(monkeypatch):
    from transformers.models.auto import configuration_auto

    monkeypatch.delitem(configuration_auto.CONFIG_MAPPING._mapping, "qwen3")  # as in a transformers before 4.51
    one_line_error(r"config class 'qwen3' \(added in transformers 4.51\)", "qwen3-8b")


def test_task_the_model_has_no_head_for():
    message = one_line_error(
        "llama has no head for task 'image-classification'", "llama-3.2-1b", task="image-classification"
    )
    assert "causal-lm" in message


def test_unknown_task_dtype_quantize_and_bad_sizes():
    one_line_error("unknown task 'translation'", "gpt2", task="translation")
    one_line_error("unknown dtype 'fp8'", "gpt2", dtype="fp8")
    one_line_error("unknown quantize 'nf3'", "gpt2", quantize="nf3", lora="r=8")
    one_line_error("give lora= too", "gpt2", quantize="nf4")
    one_line_error("batch_size must be", "gpt2", batch_size=0)
    one_line_error("longer than the model's 1024 positions", "gpt2", seq_len=4096)


def test_bad_lora_settings():
    one_line_error("cannot read LoRA setting 'r16'", "gpt2", lora="r16")
    one_line_error("lora= takes a peft LoraConfig", "gpt2", lora=16.5)
    one_line_error("bad LoRA settings", "gpt2", lora=dict(r=8, nonsense=1))


def test_parse_lora_reads_plain_strings():
    assert parse_lora("16") == {"r": 16}
    assert parse_lora("r=16, alpha=32, target_modules=q_proj+v_proj, dropout=0.05") == {
        "r": 16,
        "alpha": 32,
        "target_modules": ["q_proj", "v_proj"],
        "dropout": 0.05,
    }
    assert parse_lora("r=8,target=all-linear") == {"r": 8, "target": "all-linear"}
