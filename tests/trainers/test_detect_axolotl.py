"""``detect`` tells axolotl's YAML by axolotl's own keys: a config with none of the batch fields
(``micro_batch_size``, ``sequence_len``) was read as Hugging Face's ``TrainingArguments``."""

from __future__ import annotations

import dataclasses

import pytest

from memsave_nb.trainers import _AXOLOTL_ONLY, detect, from_trainer

from .conftest import tiny_llama

# an axolotl LoRA config as users write them, with no batch or sequence field
NO_BATCH_FIELDS = """\
datasets:
  - path: tatsu-lab/alpaca
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.05
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
gradient_checkpointing: true
bf16: auto
num_epochs: 3
"""


def test_a_config_with_no_batch_fields_is_axolotl_and_read_by_its_reader():
    assert detect(NO_BATCH_FIELDS) == "axolotl"
    imported = from_trainer(NO_BATCH_FIELDS, tiny_llama())
    # axolotl's reader says what it did with axolotl's own fields (the HF reader knows neither)
    text = " ".join(imported.notes)
    assert "bf16: auto" in text and "adapter" in text
    assert imported.plan.precision is not None  # bf16: auto sized as bf16


@pytest.mark.parametrize("key", _AXOLOTL_ONLY)
def test_each_axolotl_key_alone_is_axolotl(key):
    assert detect({key: "x"}) == "axolotl"


def test_offload_checkpointing_is_axolotl_and_plain_flags_stay_hf():
    assert detect({"gradient_checkpointing": "offload"}) == "axolotl"
    assert detect({"gradient_checkpointing": True}) == "hf"
    assert detect({"per_device_train_batch_size": 2, "bf16": True}) == "hf"


def test_no_axolotl_key_is_a_field_of_the_other_trainers():
    """The oracle: the installed TrainingArguments, SFTConfig, TRL's ModelConfig and accelerate's
    config dataclasses; a shared key would send their configs to axolotl's reader."""
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from accelerate.commands.config.config_args import ClusterConfig

    others = set()
    for cls in (transformers.TrainingArguments, trl.SFTConfig, trl.ModelConfig, ClusterConfig):
        others |= {f.name for f in dataclasses.fields(cls)}
    assert not others & set(_AXOLOTL_ONLY)
