"""A whole number of 100,000 digits in a trainer config: one line naming the field, not Python's
"Exceeds the limit (4300 digits) for integer string conversion" (which named no field)."""

from __future__ import annotations

import json

import pytest

from memsave_nb import cli
from memsave_nb.trainers import TrainerConfigError, from_trainer
from memsave_nb.trainers.safe_read import MAX_DIGITS

from .conftest import tiny_llama

HUGE = "9" * 100_000

CASES = [
    ("args.json", '{"per_device_train_batch_size": ' + HUGE + "}", "per_device_train_batch_size"),
    ("args.json", '{"fsdp_config": {"min_num_params": -' + HUGE + "}}", "min_num_params"),
    ("axolotl.yaml", "base_model: x\nmicro_batch_size: " + HUGE + "\n", "micro_batch_size"),
    ("axolotl.yaml", "datasets:\n  - path: x\n    shards: [1, " + HUGE + "]\n", "shards"),
]


@pytest.mark.parametrize("name, text, field", CASES)
def test_the_field_is_named_in_one_line(tmp_path, name, text, field):
    path = tmp_path / name
    path.write_text(text)
    for config in (str(path), text):  # a file and the same text
        with pytest.raises(TrainerConfigError) as info:
            from_trainer(config, tiny_llama())
        message = str(info.value)
        assert f"field {field!r}" in message and "100000 digits" in message, message
        assert "4300" not in message and "\n" not in message and len(message) <= 200


def test_numbers_up_to_the_limit_still_read(tmp_path):
    """The cut is in digits read, not in values: the trainer's own range checks still speak."""
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": int("9" * MAX_DIGITS)}))
    with pytest.raises(TrainerConfigError, match="per_device_train_batch_size: must be a whole number"):
        from_trainer(str(path), tiny_llama())
    path.write_text(json.dumps({"per_device_train_batch_size": 3}))
    assert from_trainer(str(path), tiny_llama()).plan.batch_size == 3


def test_the_cli_says_it_in_one_line(tmp_path, tiny, capsys):
    path = tmp_path / "args.yaml"
    path.write_text("per_device_train_batch_size: " + HUGE + "\n")
    assert cli.main(["report", "--model", tiny, "--from-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'per_device_train_batch_size'" in err and len(err) <= 200, err
