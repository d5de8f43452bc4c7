"""A Llama-7B-shaped decoder in fake mode: sized on a 2-core CPU machine, no memory, seconds."""

from __future__ import annotations

import time

from memsave_nb import measure, zoo
from memsave_nb.zoo import GPT_7B

BF16 = 2


def llama_7b_parameter_count() -> int:
    c = GPT_7B
    d, h, layers, vocab = c.n_embd, c.mlp_hidden, c.n_layer, c.vocab_size
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    return 2 * vocab * d + c.block_size * d + layers * per_layer + d  # tok embedding, head, positions, final norm


def test_7b_fake_measures_and_counts_parameters():
    wl = zoo.make("gpt-7b")
    start = time.perf_counter()
    m = measure(wl, "fake", flops=True)
    seconds = time.perf_counter() - start
    params = llama_7b_parameter_count()
    assert params == 6_738_415_616 + GPT_7B.block_size * GPT_7B.n_embd  # Llama-2-7B's count, plus learned positions
    assert m.peak_split.parameters == params * BF16
    assert m.module("").saved_bytes == m.saved_bytes > 0
    assert sum(r.params for r in m.modules) == params
    # AdamW keeps two moments per parameter (bf16, like the parameters) and one 4-byte step per tensor
    n_tensors = sum(1 for _ in wl.model.parameters())
    assert m.peak_split.optimizer_state in (2 * params * BF16, 2 * params * BF16 + 4 * n_tensors)
    assert m.peak_bytes > 4 * params * BF16  # parameters + grads + two moments, at least
    # 6 N T for the matmul weights (embeddings do no matmul). Attention adds nothing here: on the
    # CPU, SDPA runs _scaled_dot_product_flash_attention_for_cpu, which torch.utils.flop_counter
    # has no formula for either.
    matmul_params = params - GPT_7B.vocab_size * GPT_7B.n_embd - GPT_7B.block_size * GPT_7B.n_embd
    assert abs(m.flops - 6 * matmul_params * 2048) < 1e-3 * m.flops
    assert seconds < 60, f"fake 7B step took {seconds:.1f} s"
