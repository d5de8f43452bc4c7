"""Models by name from strangers (issue 38), fuzzed with hypothesis: ``from_pretrained``'s arguments,
config files and ``lora``/``quantize`` strings.

Every input gives a Workload sized right or one line (a MemsaveError of at most 200 characters),
within a stated bound of time (:data:`SECONDS` per call) and memory (:data:`PY_BYTES` of Python
allocations per call), and changes nothing the caller gave: not the file, not the overrides dict,
not a ``PretrainedConfig`` or ``LoraConfig`` object. "Sized right": the built model has the
parameters (names and shapes) that transformers itself builds from the same config fields, with
transformers' default attention; the batch is ``batch_size x seq_len`` with labels in their own
storage. Offline (an empty hub cache, ``HF_HUB_OFFLINE=1``): nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from memsave_nb import MemsaveError
from memsave_nb.hub import from_pretrained
from memsave_nb.hub.configs import CODE_KEYS
from memsave_nb.workload import Workload

SECONDS = 10.0  # per call, on a loaded 2-core CI machine; typical calls take 5-100 ms
PY_BYTES = 256 * 2**20  # Python allocations per call (tracemalloc): a config file is read up to 4 MiB
DEEP = int(os.environ.get("HUB_FUZZ_EXAMPLES", "0"))  # a longer random search by hand: HUB_FUZZ_EXAMPLES=2000
FUZZ = settings(
    max_examples=DEEP or 120,
    deadline=None,
    derandomize=not DEEP,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

TINY = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=64),
    "llama": dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
    ),
    "t5": dict(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, d_kv=8, num_heads=4, vocab_size=300),
}
PAYLOADS = [
    "",
    "\x00",
    "a" * 100_000,
    "\n" * 3 + "x",
    "é\u200b\U0001f600",
    "some-org/some-kernel",
    "flash_attention_2",
    "../../etc/passwd",
    "/dev/zero",
    "{",
    "[]",
    "all-linear",
    "r=16",
    "nf4",
    "-1",
    "1e309",
    "NaN",
    "²",
]
hostile = st.one_of(
    st.sampled_from(PAYLOADS), st.text(max_size=12), st.integers(1, 300).map(lambda n: "x" * (n * 1000))
)  # up to 300 kB in one value
numbers = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([0, -1, 10**6, 10**12, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
values = st.recursive(
    st.none() | numbers | hostile,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(hostile, c, max_size=2),
    max_leaves=6,
)
SIZE_FIELDS = sorted({k for v in TINY.values() for k in v} | {"head_dim", "num_labels", "num_local_experts"})
field_names = st.one_of(st.sampled_from(SIZE_FIELDS), st.sampled_from(sorted(CODE_KEYS)), hostile)


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    import huggingface_hub.constants as hub_constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hub-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def reference_params(fields: dict, task_model: torch.nn.Module) -> dict[str, tuple]:
    """What transformers itself builds from the same config fields (the code keys dropped), on meta."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[fields["model_type"]](
        **{k: v for k, v in fields.items() if k not in CODE_KEYS and not k.startswith("_")}
    )
    with torch.device("meta"):
        model = type(task_model)._from_config(config, dtype=task_model.dtype)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def outcome(*args, **kwargs):
    """``from_pretrained(*args, **kwargs)`` within the bounds: a Workload, or the message of a one-line error."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = from_pretrained(*args, **kwargs)
    except MemsaveError as exc:
        result = str(exc)
        assert "\n" not in result and "\r" not in result and 0 < len(result) <= 200, result[:300]
    finally:
        took = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert took < SECONDS, f"{took:.1f} s"
    assert peak < PY_BYTES, f"{peak:,} B"
    with contextlib.suppress(InvalidArgument):  # outside hypothesis there is nothing to count
        event("sized" if isinstance(result, Workload) else "refused")
    if os.environ.get("HUB_FUZZ_LOG"):
        with open(os.environ["HUB_FUZZ_LOG"], "a") as log:
            log.write(("SIZED" if isinstance(result, Workload) else result)[:120] + "\n")
    if isinstance(result, Workload):
        assert result.model.config._attn_implementation in ("sdpa", "eager")
        batch = result.make_batch()
        if "input_ids" in batch and batch["labels"].dim() == 2:
            assert batch["labels"].untyped_storage() is not batch["input_ids"].untyped_storage()
            assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    return result


config_files = st.one_of(
    st.builds(
        lambda t, extra: {"model_type": t, **TINY[t], **extra},
        st.sampled_from(sorted(TINY)),
        st.dictionaries(field_names, values, max_size=3),
    ),
    st.dictionaries(field_names, values, max_size=4).map(lambda d: {"model_type": "gpt2", **d}),
    values,
)
raw_files = st.one_of(
    config_files.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=64),
    st.integers(1, 50_000).map(lambda n: b"[" * n + b"]" * n),
    st.just(b'{"model_type": "gpt2", "n_layer": ' + b"7" * 5000 + b"}"),
)


@FUZZ
@given(raw=raw_files)
def test_any_config_file_is_sized_right_or_refused_in_one_line(raw, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(raw)
    result = outcome(str(path.parent))
    assert path.read_bytes() == raw
    if isinstance(result, Workload):
        fields = json.loads(raw)
        assert {n: tuple(p.shape) for n, p in result.model.named_parameters()} == reference_params(fields, result.model)


lora_strings = st.one_of(
    st.lists(
        st.tuples(
            st.sampled_from(["r", "alpha", "dropout", "target_modules", "rank", "save", "bias", "x"]),
            st.one_of(
                st.sampled_from(
                    [
                        "16",
                        "16.5",
                        "abc",
                        "0",
                        "-4",
                        "1e9",
                        "9" * 5000,
                        "nan",
                        "inf",
                        "all-linear",
                        "q_proj+v_proj",
                        "c_attn",
                        "none",
                        "0.1",
                        "²",
                        "(",
                    ]
                ),
                hostile,
            ),
        ),
        max_size=3,
    ).map(lambda kv: ",".join(f"{k}={v}" for k, v in kv)),
    hostile,
    st.integers(-5, 100_000).map(str),
)
loras = st.one_of(
    st.none(),
    lora_strings,
    st.dictionaries(st.sampled_from(["r", "alpha", "dropout", "target_modules"]), values, max_size=3),
    numbers,
)
quantizes = st.one_of(st.none(), st.sampled_from(["nf4", "int8", "NF4", "fp4", ""]), hostile)


def mostly(good, bad):
    """``good`` seven times in eight: enough arguments are all good that most examples build a model."""
    return st.tuples(st.integers(0, 7), good, bad).map(lambda t: t[2] if t[0] == 7 else t[1])


@FUZZ
@given(
    name=mostly(st.sampled_from(["gpt2", "llama-3.2-1b", "t5-base"]), st.one_of(st.just("org/model"), hostile, values)),
    lora=mostly(
        st.one_of(st.none(), st.sampled_from(["r=4", "8", "r=2,alpha=4,dropout=0.1", "r=2,target=all-linear"])), loras
    ),
    quantize=mostly(st.sampled_from([None, None, "nf4", "int8"]), quantizes),
    batch_size=mostly(st.integers(1, 3), st.one_of(st.integers(-2, 0), values)),
    seq_len=mostly(st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.integers(-2, 0), st.just(65), values)),
    dtype=mostly(
        st.sampled_from(["bf16", "fp32", "fp16", torch.float32]),
        st.one_of(st.sampled_from([torch.int64, torch.float64, torch.bool, torch.float8_e4m3fn]), hostile),
    ),
    task=mostly(
        st.none(), st.one_of(st.sampled_from(["causal-lm", "seq2seq", "masked_lm", "seq-classification"]), hostile)
    ),
    overrides=mostly(st.none(), st.one_of(st.dictionaries(field_names, values, max_size=2), values)),
    revision=mostly(st.none(), st.one_of(hostile, numbers)),
    seed=mostly(st.integers(0, 5), numbers),
    optimizer=mostly(st.sampled_from(["adamw", "sgd", "none", None]), st.one_of(hostile, numbers)),
    empty_weights=mostly(st.just(True), st.just(False)),
)
def test_any_arguments_are_sized_right_or_refused_in_one_line(
    name, lora, quantize, batch_size, seq_len, dtype, task, overrides, revision, seed, optimizer, empty_weights
):
    base = "gpt2" if not isinstance(name, str) or name not in ("llama-3.2-1b", "t5-base") else name
    shrink = {"gpt2": TINY["gpt2"], "llama-3.2-1b": TINY["llama"], "t5-base": TINY["t5"]}[base]
    given_overrides = dict(shrink, **overrides) if isinstance(overrides, dict) else overrides
    if not empty_weights and overrides is None:
        given_overrides = shrink  # random weights take time by size (GPT-2 124M with nf4: ~4.5 s here): small ones only
    before = copy.deepcopy((lora, given_overrides))
    result = outcome(
        name,
        lora=lora,
        quantize=quantize,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=dtype,
        task=task,
        overrides=given_overrides,
        revision=revision,
        seed=seed,
        optimizer=optimizer,
        empty_weights=empty_weights,
    )
    assert (lora, given_overrides) == before or before != before  # NaN inside compares unequal to itself
    if isinstance(result, Workload):
        assert {p.device.type for p in result.model.parameters()} == {"meta" if empty_weights else "cpu"}
        batch = result.make_batch()
        key = "input_ids" if "input_ids" in batch else "pixel_values"
        assert batch[key].shape[0] == batch_size
        if key == "input_ids":
            assert batch[key].shape[1] == (seq_len or batch[key].shape[1])
        if quantize is not None:
            from memsave_nb.hub.quant import QuantLinear

            assert any(isinstance(m, QuantLinear) for m in result.model.modules())


@FUZZ
@given(
    lora=mostly(
        st.sampled_from(
            [
                "r=4",
                "2",
                "r=2,alpha=0.5,dropout=0",
                "r=3,target=q_proj+v_proj",
                "rank=2,save=lm_head",
                "r=2,target=all-linear",
                "r=1,bias=all",
            ]
        ),
        lora_strings,
    ),
    quantize=mostly(st.sampled_from([None, "nf4", "int8"]), quantizes),
)
def test_lora_and_quantize_strings_on_a_real_model(lora, quantize):
    """On a tiny Llama: an adapter of the rank asked for, frozen base; or one line."""
    result = outcome("llama-3.2-1b", overrides=TINY["llama"], lora=lora or None, quantize=quantize)
    if isinstance(result, Workload) and lora:
        trainable = [n for n, p in result.model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
        rank = result.model.peft_config["default"].r
        assert all(p.shape[0] == rank for n, p in result.model.named_parameters() if "lora_A" in n)


def test_a_peft_and_a_transformers_config_object_are_left_as_they_were():
    from peft import LoraConfig
    from transformers import LlamaConfig

    mine = LoraConfig(r=4, lora_alpha=8)  # no target_modules: apply_lora would write 'all-linear' into it
    cfg = LlamaConfig(**TINY["llama"])
    cfg_before, lora_before = cfg.to_dict(), copy.deepcopy(mine.to_dict())
    wl = outcome(cfg, lora=mine, overrides={"num_hidden_layers": 1})
    assert isinstance(wl, Workload)
    assert cfg.to_dict() == cfg_before and mine.to_dict() == lora_before


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: os.mkfifo(p), "is not a regular file"),
        (lambda p: os.symlink("/dev/zero", p), "is not a regular file"),
        (lambda p: p.write_bytes(b" " * (4 * 2**20 + 1)), "a config.json is read up to 4,194,304"),
        (lambda p: p.write_bytes(b"\xff\xfe{}"), "UnicodeDecodeError"),
        (lambda p: p.write_text("[1, 2]"), "holds a JSON list, not an object"),
        (
            lambda p: p.write_text(json.dumps({"model_type": "gpt2", "n_layer": 10**6})),
            "1,000,000 layers; .* up to 1,024",
        ),
        (
            lambda p: p.write_text(
                json.dumps({"model_type": "llama", **TINY["llama"], "vocab_size": 2**31 - 1, "hidden_size": 2**20})
            ),
            "estimates 4.51e\\+15 parameters; .* up to 1e\\+13",
        ),
        (
            lambda p: p.write_text(json.dumps({"model_type": "gpt2", "n_embd": 0})),
            "n_embd must be a whole number from 1",
        ),
        (
            lambda p: p.write_text(json.dumps({"model_type": "gpt2", "n_head": -4})),
            "n_head must be a whole number from 1",
        ),
    ],
)
def test_files_that_would_hang_fill_memory_or_build_forever_are_refused(tmp_path, make, message):
    make(tmp_path / "config.json")
    result = outcome(str(tmp_path / "config.json"))
    assert isinstance(result, str)
    import re

    assert re.search(message, result), result


def test_random_weights_are_refused_over_the_memory_bound():
    result = outcome(
        "gpt2", overrides=dict(TINY["gpt2"], vocab_size=10**8, n_embd=64), empty_weights=False, dtype="fp32"
    )
    assert isinstance(result, str) and "about 47.7 GiB here (limit 4 GiB)" in result, result


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora="r=abc"), "LoRA r must be a whole number from 1 to 65536, got 'abc'"),
        (dict(lora="r=16.5"), "LoRA r must be a whole number from 1 to 65536, got 16.5"),
        (dict(lora="r=" + "9" * 5000), "LoRA r must be a whole number"),
        (dict(dtype=torch.int64), "unknown dtype torch.int64"),
        (dict(task="x" * 400_000), "unknown task 'xxx"),
        (dict(lora="x" * 400_000), "cannot read LoRA setting 'xxx"),
        (dict(overrides={"attn_implementation": "flash_attention_2"}), "overrides cannot set 'attn_implementation'"),
        (dict(seq_len=10**5000), "seq_len must be a whole number from 1 to 134,217,728, got <int>"),
        (
            dict(batch_size=2**20, seq_len=1024),
            "batch_size x seq_len = 1,073,741,824 tokens; models by name are sized up to",
        ),
        (dict(optimizer="x" * 400_000), "optimizer= takes a name like 'adamw'"),
    ],
)
def test_the_issue_examples_are_one_short_line(kwargs, message):
    kwargs.setdefault("overrides", TINY["gpt2"])
    result = outcome("gpt2", **kwargs)
    assert isinstance(result, str) and result.startswith(message) or message in result, result


def test_a_path_swapped_for_a_fifo_after_the_check_does_not_hang(tmp_path, monkeypatch):
    """The file is checked again once open (opened non-blocking): the stat saw a regular file, the
    open finds a FIFO with no writer, and the answer is one line within a second, not a hang."""
    import threading

    from memsave_nb.hub import configs

    regular = tmp_path / "regular.json"
    regular.write_text("{}")
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(configs, "_stat", lambda path: os.stat(regular))  # what a stat before the swap saw
    answer = []
    reader = threading.Thread(target=lambda: answer.append(outcome(str(fifo))), daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # unblock the reader so the test process can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO blocked")
    assert answer and "is not a regular file" in answer[0]
