"""Hugging Face models (GPT-2, Llama, BERT, T5, a peft LoRA Llama) from small configs.

- saved_bytes equals what ``saved_tensors_hooks`` count (unique storages; no checkpointing here),
  output_bytes equals the output storages (logits, KV cache, loss) autograd did not save;
- the steady-state peak equals MemTracker's second step, the first-step peak its first step
  (LoRA: a MemTracker subclass that hooks trainable parameters only), real and fake mode;
- a model built on the meta device measures in fake mode exactly like one built under
  FakeTensorMode.
"""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure
from memsave_nb.model_state import ModelSnapshot

from .hf_models import MODELS, llama_config
from .oracles import frozen_aware_memtracker, memtracker_count, saved_tensors_hooks_count

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_saved_and_outputs_against_hooks(name):
    wl = MODELS[name]()
    m = measure(wl, repeats=0)
    saved, outputs = saved_tensors_hooks_count(wl)
    assert m.saved_bytes == saved
    assert m.output_bytes == outputs
    assert m.end_of_forward.activations == m.saved_bytes and m.end_of_forward.outputs == m.output_bytes
    parts = dict(m.output_parts)
    if name in ("gpt2", "llama", "t5"):
        logits = 2 * 32 * 1000 * 4
        assert parts["logits"] == logits  # returned, never saved: cross-entropy keeps its log-softmax
        assert m.module("lm_head").output_bytes_own == logits
    assert sum(parts.values()) == m.output_bytes == m.module("").output_bytes


def test_kv_cache_counted_and_advised():
    wl = MODELS["gpt2"](batch=2, seq=64, layers=2, d=256)
    m = measure(wl, repeats=0)
    cache = dict(m.output_parts)["cache"]  # transformers 5 names GPT-2's past_key_values "cache"
    assert cache > 0.01 * (m.saved_bytes + m.output_bytes)
    no_cache = measure(wl.replace(batch={**wl.batch, "use_cache": False}), repeats=0)
    assert m.output_bytes - no_cache.output_bytes == cache
    assert no_cache.saved_bytes == m.saved_bytes
    assert any("use_cache=False" in a for a in m.advice)
    assert not any("use_cache=False" in a for a in no_cache.advice)


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("name", ["llama", "lora-llama"])
def test_steady_state_is_memtrackers_second_step(name, mode):
    wl = MODELS[name]()
    tracker_cls = frozen_aware_memtracker() if name.startswith("lora") else None
    before = ModelSnapshot.capture(wl.model)
    m = measure(wl, mode, repeats=0, first_step_peak=True)
    assert before.differences(wl.model) == []
    assert m.peak_bytes == memtracker_count(wl, iterations=2, tracker_cls=tracker_cls).peak_bytes
    assert m.peak_bytes == measure(wl, mode, repeats=0).peak_bytes  # state made without a first step
    assert m.first_step_peak_bytes == memtracker_count(wl, iterations=1, tracker_cls=tracker_cls).peak_bytes
    assert m.peak_bytes > m.first_step_peak_bytes


def test_meta_llama_in_fake_mode_equals_fake_built():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaForCausalLM

    from memsave_nb import Workload

    ids = torch.randint(0, 1000, (2, 64))
    batch = {"input_ids": ids, "labels": ids}
    with torch.device("meta"):
        on_meta = LlamaForCausalLM(llama_config(2, 128))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_built = LlamaForCausalLM(llama_config(2, 128))
    a = measure(Workload(on_meta, batch), "fake")
    b = measure(Workload(fake_built, batch), "fake")
    assert (a.peak_bytes, a.first_step_peak_bytes, a.saved_bytes, a.output_bytes) == (
        b.peak_bytes,
        b.first_step_peak_bytes,
        b.saved_bytes,
        b.output_bytes,
    )
    assert a.timeline.total() == b.timeline.total()


def test_error_in_t5s_own_forward_names_the_root():
    from memsave_nb import StepError

    wl = MODELS["t5"]()
    batch = {"input_ids": wl.batch["input_ids"], "labels": wl.batch["labels"][:, :0]}  # no target tokens
    with pytest.raises(
        StepError, match=r"step failed during forward in module <root> \(T5ForConditionalGeneration\): IndexError"
    ):
        measure(wl.replace(batch=batch), repeats=0)
