"""Hugging Face models built from small configs (random weights, nothing downloaded), as a
fine-tuning user builds them, for the engine tests and bench/bench_real_models.py."""

from __future__ import annotations

from typing import Callable

import torch

from memsave_nb import Workload

VOCAB = 1000


def _ids(batch: int, seq: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def gpt2(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers, n_embd=d, n_head=4, vocab_size=vocab, n_positions=max(64, seq), bos_token_id=0, eos_token_id=0
    )
    ids = _ids(batch, seq, vocab)
    return Workload(GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}, name="gpt2")


def llama_config(layers: int = 2, d: int = 64, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
    )


def llama(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ids = _ids(batch, seq, vocab)
    return Workload(LlamaForCausalLM(llama_config(layers, d, vocab)), {"input_ids": ids, "labels": ids}, name="llama")


def bert(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=2 * d,
        vocab_size=vocab,
        max_position_embeddings=max(64, seq),
    )
    ids = _ids(batch, seq, vocab)
    return Workload(
        BertForSequenceClassification(cfg),
        {"input_ids": ids, "labels": torch.tensor([0, 1] * (batch // 2) + [0] * (batch % 2))},
        name="bert",
    )


def t5(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        d_model=d,
        d_kv=16,
        d_ff=2 * d,
        num_layers=layers,
        num_heads=4,
        vocab_size=vocab,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    ids = _ids(batch, seq, vocab)
    return Workload(T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": ids}, name="t5")


def lora_llama(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    from peft import LoraConfig, get_peft_model

    wl = llama(batch, seq, layers=layers, d=d, vocab=vocab)
    torch.manual_seed(1)
    model = get_peft_model(wl.model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return Workload(model, wl.batch, name="lora-llama")


def qwen2(batch: int = 2, seq: int = 32, *, layers: int = 2, d: int = 64, vocab: int = VOCAB) -> Workload:
    """Qwen2's shape in small: grouped-query attention with biased q/k/v, tied embeddings off."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=d,
        intermediate_size=3 * d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = _ids(batch, seq, vocab)
    return Workload(Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}, name="qwen2")


MODELS: dict[str, Callable[..., Workload]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "lora-llama": lora_llama,
    "qwen2": qwen2,
}
