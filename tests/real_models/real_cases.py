"""The real models of the suite, as data: a name, a builder of (model, batch) from a small config.

transformers and peft are test dependencies; a missing one skips its cases with the reason.
Batches are token ids plus labels, so each model computes its own loss (``output.loss``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

from memsave_nb.workload import Workload

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 128, 64, 2, 4, 16, 2


def _transformers():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    transformers.logging.set_verbosity_error()
    return transformers


def _ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # (B, T)


def gpt2() -> tuple[nn.Module, Any]:
    t = _transformers()
    cfg = t.GPT2Config(
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=2 * SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = _ids()
    return t.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def bert() -> tuple[nn.Module, Any]:
    t = _transformers()
    cfg = t.BertConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
    )
    ids = _ids()
    return t.BertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def _llama_config(t):
    return t.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def llama() -> tuple[nn.Module, Any]:
    t = _transformers()
    ids = _ids()
    return t.LlamaForCausalLM(_llama_config(t)), {"input_ids": ids, "labels": ids}


def t5() -> tuple[nn.Module, Any]:
    t = _transformers()
    cfg = t.T5Config(
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_heads=HEADS,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return t.T5ForConditionalGeneration(cfg), {"input_ids": _ids(1), "labels": _ids(2)[:, : SEQ // 2].contiguous()}


def lora_llama() -> tuple[nn.Module, Any]:
    t = _transformers()
    peft = pytest.importorskip("peft", reason="peft is not installed (test extra)")
    base = t.LlamaForCausalLM(_llama_config(t))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    # peft initialises lora_B to zero, so lora_A's gradient would be zero too: give B values
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


@dataclass(frozen=True)
class RealCase:
    name: str
    make: Callable[[], tuple[nn.Module, Any]]
    workload: Workload | None = None

    @property
    def model(self) -> nn.Module:
        return self.workload.model

    def fresh(self) -> Workload:
        """A new copy of the same model (same weights) and batch, for tests that change it."""
        return build(self).workload


CASES = [
    RealCase("gpt2", gpt2),
    RealCase("bert", bert),
    RealCase("llama", llama),
    RealCase("t5", t5),
    RealCase("lora-llama", lora_llama),
]
_SHARED: dict[str, RealCase] = {}


def build(case: RealCase) -> RealCase:
    """The case with a newly built workload (seeded: every build has the same weights)."""
    torch.manual_seed(0)
    model, batch = case.make()
    model.train()
    return dataclasses.replace(case, workload=Workload(model, batch, name=case.name))


def shared(case: RealCase) -> RealCase:
    """The case's workload built once per session, for tests that leave the model as it was."""
    if case.name not in _SHARED:
        _SHARED[case.name] = build(case)
    return _SHARED[case.name]


def case_named(name: str) -> RealCase:
    return next(c for c in CASES if c.name == name)
