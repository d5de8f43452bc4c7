"""``memsave-nb report --model <config.json> --from-config <fields>`` (issue 41): the model is
built in the dtype the trainer's script loads (config.json's ``dtype``, else float32), the
trainer's bf16/fp16 fields are mixed precision over it, and the printed peak is the Python path's."""

from __future__ import annotations

import json

import pytest

import memsave_nb
from memsave_nb import cli, measure
from memsave_nb.trainers import from_trainer
from memsave_nb.units import format_bytes

TINY = {
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


def _model(tmp_path, dtype):
    folder = tmp_path / f"tiny-{dtype}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, "dtype": dtype}))
    return str(folder)


@pytest.mark.parametrize(
    "dtype, fields, precision",
    [
        ("float32", {"per_device_train_batch_size": 2, "bf16": True}, "autocast_bf16"),
        ("float32", {"per_device_train_batch_size": 2, "bf16": False}, "fp32"),
        ("bfloat16", {"per_device_train_batch_size": 2, "bf16": True}, "bf16"),
    ],
)
def test_report_from_config_equals_the_python_path_in_the_models_dtype(capsys, tmp_path, dtype, fields, precision):
    model = _model(tmp_path, dtype)
    args = tmp_path / "fields.json"
    args.write_text(json.dumps(fields))
    assert cli.main(["report", "--model", model, "--seq-len", "32", "--from-config", str(args)]) == 0
    out = capsys.readouterr().out
    wl = memsave_nb.from_pretrained(model, seq_len=32, dtype=dtype)
    imported = from_trainer(fields, wl.model)
    assert imported.plan.precision == precision  # mixed precision over fp32 weights, never a silent cast
    with imported.plan.apply(wl) as w:
        m = measure(w, mode="fake")
    assert out.splitlines()[2].startswith(f"Peak memory: {format_bytes(m.peak_bytes)} during {m.peak_phase}")


def test_a_fifo_or_a_misspelt_field_is_one_line_before_any_build(capsys, tmp_path):
    import os

    model = _model(tmp_path, "float32")
    fifo = tmp_path / "args"
    os.mkfifo(fifo)
    assert cli.main(["report", "--model", model, "--from-config", str(fifo)]) != 0
    err = capsys.readouterr().err.strip()
    assert "not a regular file" in err and len(err.splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"per_device_train_batch_sise": 64}))
    assert cli.main(["report", "--model", model, "--from-config", str(bad)]) != 0
    err = capsys.readouterr().err.strip()
    assert "did you mean 'per_device_train_batch_size'" in err and len(err.splitlines()) == 1


def test_precision_beside_from_config_says_where_precision_comes_from(capsys, tmp_path):
    args = tmp_path / "fields.json"
    args.write_text(json.dumps({"bf16": True}))
    assert (
        cli.main(["report", "--model", _model(tmp_path, "float32"), "--precision", "bf16", "--from-config", str(args)])
        != 0
    )
    err = capsys.readouterr().err.strip()
    assert "--precision" in err and "config.json" in err and len(err.splitlines()) == 1 and len(err) <= 220
