"""Trainer configs from strangers (issue 38 items 4-5, issue 41's fields), fuzzed with hypothesis.

Every config in every format (a dict, JSON text, YAML text, a file) for every trainer is either
sized right -- the batch, accumulation, length and precision it says are the plan's, exactly -- or
refused in one line of at most 200 characters, within a time bound, with the model unchanged.
Then the hostile files the issue names: an alias bomb, deep nesting, a FIFO, /dev/zero, a file
over the size limit, a regex that backtracks for ever.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
import time
import tracemalloc

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsave_nb.errors import MemsaveError
from memsave_nb.trainers import TrainerConfigError, from_trainer, load_config
from memsave_nb.trainers.fields import class_fields
from memsave_nb.trainers.hf import optim_names
from memsave_nb.trainers.safe_read import MAX_ALIASES, MAX_BYTES, read_file

from .conftest import tiny_llama

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL = tiny_llama()
SECONDS = 2.0  # each read, hostile or not; the slowest honest one here takes a few ms

FIELDS = {
    "hf": [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "optim",
        "gradient_checkpointing",
        "activation_checkpointing_kwargs",
        "fsdp",
        "fsdp_config",
        "label_smoothing_factor",
        "per_device_train_batch_sise",
        "seed",
    ],
    "trl": [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "max_length",
        "loss_type",
        "activation_offloading",
        "gradient_checkpointing_kwargs",
        "max_seq_length",
        "packing",
    ],
    "axolotl": [
        "micro_batch_size",
        "sequence_len",
        "gradient_accumulation_steps",
        "bf16",
        "fp16",
        "optimizer",
        "gradient_checkpointing",
        "unfrozen_parameters",
        "selective_checkpointing",
        "fsdp_version",
        "fsdp_config",
    ],
    "accelerate": ["mixed_precision", "distributed_type", "num_processes", "fsdp_config"],
}
SIZES = {
    "hf": ("per_device_train_batch_size", "gradient_accumulation_steps", None),
    "trl": ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
    "axolotl": ("micro_batch_size", "gradient_accumulation_steps", "sequence_len"),
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2.5, 1.0, 0.0, -0.1, 0.1]),
    st.sampled_from(
        [
            "abc",
            "",
            "true",
            "False",
            "auto",
            "bf16",
            "no",
            "FSDP",
            "MULTI_GPU",
            "adamw_torch",
            "adafactor",
            "lion_8bit",
            "nll",
            "dft",
            "full_shard offload",
            "(a+)+$",
            "model\\.layers\\.1.*",
            "1e9",
        ]
    ),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "every_n_layers",
                    "offload",
                    "version",
                    "save",
                    "fsdp_offload_params",
                    "activation_checkpointing",
                    "transformer_layer_cls_to_wrap",
                    "x",
                ]
            ),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=6,
)


def _state(model: torch.nn.Module) -> tuple:
    return (
        tuple(
            (n, p.data_ptr(), p.dtype, p.requires_grad, float(p.detach().double().sum()))
            for n, p in model.named_parameters()
        ),
        tuple(m.training for m in model.modules()),
    )


BEFORE = _state(MODEL)
SCRATCH = tempfile.mkdtemp(prefix="memsave-trainer-fuzz-")
atexit.register(shutil.rmtree, SCRATCH, True)
for _trainer in ("hf", "trl"):  # import the classes whose fields are checked once, outside the timed reads
    class_fields(_trainer)
optim_names()


def _read_one_line(trainer: str, config: object, d: dict):
    t0 = time.perf_counter()
    try:
        out = from_trainer(config, MODEL, trainer=trainer, world_size=2)
    except MemsaveError as exc:
        msg = str(exc)
        assert "\n" not in msg and 0 < len(msg) <= 200, msg
        out = None
    assert time.perf_counter() - t0 < SECONDS
    assert _state(MODEL) == BEFORE
    return out


@pytest.mark.parametrize("trainer", sorted(FIELDS))
@pytest.mark.parametrize("fmt", ["dict", "json", "yaml", "file"])
@FUZZ
@given(data=st.data())
def test_every_config_is_sized_right_or_refused_in_one_line(trainer, fmt, data):
    d = data.draw(st.dictionaries(st.sampled_from(FIELDS[trainer]), values, max_size=5))
    if fmt == "json":
        try:
            config = json.dumps(d, allow_nan=True)
        except (TypeError, ValueError):
            return
    elif fmt == "yaml":
        config = yaml.safe_dump(d) if d else "{}"
    elif fmt == "file":
        config = os.path.join(SCRATCH, "config.yaml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(d) if d else "{}")
    else:
        config = d
    before = json.dumps(d, default=repr, allow_nan=True) if fmt == "dict" else None
    out = _read_one_line(trainer, config, d)
    if fmt == "dict":
        assert json.dumps(d, default=repr, allow_nan=True) == before  # the caller's dict is left as it was
    if out is None or trainer not in SIZES:
        return
    batch_key, acc_key, seq_key = SIZES[trainer]
    plan = out.plan
    if d.get(batch_key) is not None:
        assert type(d[batch_key]) is int and plan.batch_size == d[batch_key]  # no 2.5 -> 2, True -> 1
    if d.get(acc_key) is not None:
        assert type(d[acc_key]) is int and plan.accumulation_steps == d[acc_key]
    if seq_key and d.get(seq_key) is not None:
        assert type(d[seq_key]) is int and plan.seq_len == d[seq_key]
    bf16, fp16 = d.get("bf16"), d.get("fp16")
    if bf16 is True and trainer != "accelerate":
        assert plan.precision == "autocast_bf16" and fp16 is not True  # fp32 weights: mixed precision, never a cast
    if fp16 is True:
        assert plan.precision == "autocast_fp16" and bf16 is not True


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "a:\n" + "".join(" " * (2 * i) + f"k{i}:\n" for i in range(1, 60)) + " " * 120 + "v",
        "a: " + "[" * 200 + "]" * 200,
        '{"a": ' + "[" * 100 + "]" * 100 + "}",
    ],
)
def test_deep_nesting_is_refused_in_one_line(text):
    with pytest.raises(TrainerConfigError, match="deeper than|neither|object of fields") as info:
        load_config(text)
    assert len(str(info.value)) <= 200 and "\n" not in str(info.value)


def _refused_within(read, match: str) -> tuple[float, int]:
    """Seconds to refuse (timed alone), then the traced memory peak of a second refusal."""
    t0 = time.perf_counter()
    with pytest.raises(TrainerConfigError, match=match):
        read()
    took = time.perf_counter() - t0
    tracemalloc.start()
    try:
        with pytest.raises(TrainerConfigError, match=match):
            read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return took, peak


def _bomb(levels: int = 9) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        prev = chr(ord("a") + i - 1)
        lines.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [{', '.join(['*' + prev] * 9)}]")
    lines.append("per_device_train_batch_size: 8")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("trainer", ["hf", "axolotl"])
def test_alias_bomb_is_refused_within_the_time_bound_and_a_few_mb(trainer, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())  # 9^9 = 387 million strings once expanded (the 48-105 s MemoryError of issue 38)
    took, peak = _refused_within(
        lambda: from_trainer(str(path), trainer=trainer),
        f"more than {MAX_ALIASES} YAML aliases|more than 100000 values",
    )
    assert took < SECONDS and peak < 20 * 2**20
    few = (
        "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nmicro_batch_size: 2\n"
    )  # 20 aliases, 1,000 values below c
    assert from_trainer(few, trainer="axolotl").plan.batch_size == 2
    many = few.replace("c: [", "c: &c [") + "d: [" + ", ".join(["*c"] * 10) + "]\n"  # 30 aliases, 10^4 per d ... x10
    many += "e: [" + ", ".join(["[" + ", ".join(["*c"] * 10) + "]"] * 10) + "]\n"  # 140 aliases: over the count
    with pytest.raises(TrainerConfigError, match="YAML aliases"):
        from_trainer(many, trainer="axolotl")


def _alarm(seconds: int):
    def fail(*_):
        raise AssertionError(f"read blocked for {seconds} s")

    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


def test_fifo_device_and_oversized_files_are_refused_without_reading_them(tmp_path):
    fifo = tmp_path / "args.json"
    os.mkfifo(fifo)
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    big.write_text('{"a": "' + "x" * MAX_BYTES + '"}')
    _alarm(5)
    try:
        for path in (fifo, str(fifo), link):
            with pytest.raises(TrainerConfigError, match="not a regular file"):
                load_config(path)
            with pytest.raises(TrainerConfigError, match="not a regular file"):
                read_file(str(path))
        with pytest.raises(TrainerConfigError, match=f"over {MAX_BYTES} bytes"):
            load_config(big)
        with pytest.raises(TrainerConfigError, match="cannot read"):
            load_config(tmp_path / "missing.json")
    finally:
        signal.alarm(0)


def test_a_megabyte_of_values_is_refused_within_the_time_and_memory_bounds(tmp_path):
    path = tmp_path / "many.json"
    path.write_text('{"x": [' + ",".join(["0"] * (MAX_BYTES // 2 - 8)) + "]}")  # just under 1 MiB, 524k values
    took, peak = _refused_within(lambda: load_config(path), "more than 100000 values")
    assert took < SECONDS and peak < 64 * 2**20  # the text, its parse and the walk's stack, no copy per value


def test_a_regex_that_backtracks_for_ever_is_refused_before_it_runs():
    # (a+)+$ over a 40-character name is 2^40 steps in Python's re
    for pattern in ["(m+)+$", "(model|mode)*x", "(.*a){20}", r"(x)\1", "a.*b.*c.*d.*"]:
        t0 = time.perf_counter()
        with pytest.raises(TrainerConfigError, match="unfrozen_parameters") as info:
            from_trainer({"micro_batch_size": 1, "unfrozen_parameters": [pattern]}, MODEL, trainer="axolotl")
        assert time.perf_counter() - t0 < SECONDS and len(str(info.value)) <= 200
    ok = from_trainer({"unfrozen_parameters": [r"model\.layers\.[0-1]\..*", "lm_head.*"]}, MODEL, trainer="axolotl")
    assert ok.plan.frozen == ("*",)
    assert ok.plan.trainable == tuple(
        n for n, _ in MODEL.named_parameters() if n.startswith(("model.layers.0.", "model.layers.1.", "lm_head"))
    )


@pytest.mark.parametrize(
    "trainer, d, match",
    [
        ("hf", {"per_device_train_batch_size": "abc"}, "whole number"),
        ("hf", {"per_device_train_batch_size": 2.5}, "whole number"),
        ("hf", {"per_device_train_batch_size": True}, "whole number"),
        ("hf", {"gradient_accumulation_steps": float("inf")}, "whole number"),
        (
            "hf",
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 0}},
            "every_n_layers",
        ),
        ("hf", {"gradient_checkpointing_kwargs": [1, 2]}, "mapping"),
        ("hf", {"label_smoothing_factor": float("nan")}, "label_smoothing_factor"),
        ("hf", {"bf16": "abc"}, "true or false"),
        ("hf", {"per_device_train_batch_sise": 64}, "did you mean 'per_device_train_batch_size'"),
        ("hf", {"optim": "adamw_tourch"}, "not a TrainingArguments optimizer"),
        ("trl", {"max_seq_length": 4096}, "not a field of SFTConfig"),
        ("trl", {"max_length": 0}, "whole number"),
        ("axolotl", {"bf16": True, "fp16": True}, "both set"),
        ("axolotl", {"micro_batch_size": [1]}, "whole number"),
        ("accelerate", {"distributed_type": "MULTI_GPU", "num_processes": 0}, "num_processes"),
        ("accelerate", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 3}}, "version"),
    ],
)
def test_values_the_trainer_would_refuse_are_refused_in_one_line(trainer, d, match):
    with pytest.raises(TrainerConfigError, match=match) as info:
        from_trainer(d, MODEL, trainer=trainer)
    assert len(str(info.value)) <= 200 and "\n" not in str(info.value)


def test_the_real_classes_refuse_what_we_refuse():
    """The oracle for the field checks: the installed classes raise on the same names."""
    transformers = pytest.importorskip("transformers")
    trl_pkg = pytest.importorskip("trl")
    with pytest.raises(TypeError):
        transformers.TrainingArguments(output_dir="/tmp/x", per_device_train_batch_sise=64)
    with pytest.raises(TypeError):
        trl_pkg.SFTConfig(output_dir="/tmp/x", max_seq_length=4096)
    with pytest.raises(ValueError):
        transformers.TrainingArguments(output_dir="/tmp/x", optim="adamw_tourch")


def test_fields_set_but_not_sized_are_one_note():
    imp = from_trainer({"per_device_train_batch_size": 4, "seed": 7, "learning_rate": 0.1, "logging_steps": 3}, MODEL)
    unsized = [n for n in imp.notes if n.startswith("fields set but not sized")]
    assert unsized == ["fields set but not sized (they do not change the plan): learning_rate, logging_steps, seed"]
    assert imp.plan.batch_size == 4
