"""A rank's ``saved_bytes`` is what forward leaves alive (saved for backward and what only the outputs
keep); ``saved_for_backward_bytes`` and ``output_bytes`` split it as the engine's ``saved_bytes`` and
``output_bytes`` do. Found as a 32,768 B gap: on GPT-2 sized for CUDA, the CPU's math SDPA does not
save a layer's key (its KV-cache copy is an output only, 16,384 B), CUDA's memory-efficient kernel
does, so the key moves from "outputs" to "saved" in the engine and stays in the rank's one number.
Oracle: ``saved_tensors_hooks`` on an independently built fake GPT-2 (unique storages autograd saves,
parameters and the batch left out; logits, loss and KV cache not saved), with and without CUDA's SDPA."""

from __future__ import annotations

import contextlib

import pytest
import torch

from memsave_nb import measure
from memsave_nb.measure.cuda_attention import cuda_attention
from memsave_nb.parallel import ParallelSpec, measure_parallel
from tests.measure import hf_models

pytest.importorskip("transformers")


def _gpt2(sized_for):
    """GPT-2 (2 layers, batch 2, 32 tokens, d 64), SDPA, fp32, no optimizer (as test_rank_autocast's)."""
    return hf_models.gpt2(layers=2, d=64).replace(optimizer="none", sized_for=sized_for)


def _oracle(sized: bool) -> tuple[int, int]:
    """(saved for backward, kept only by the outputs) in bytes of one fake forward with its loss."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0)
    with FakeTensorMode():
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1000, (2, 32))
        skip = {id(p.untyped_storage()) for p in model.parameters()} | {id(ids.untyped_storage())}
        saved: dict[int, torch.UntypedStorage] = {}  # held: no id is reused while counting

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t.untyped_storage()) not in skip:
                saved[id(t.untyped_storage())] = t.untyped_storage()
            return t

        with cuda_attention() if sized else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(input_ids=ids, labels=ids)
        kept = [out.logits, out.loss] + [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
        only_out = {id(t.untyped_storage()): t.untyped_storage() for t in kept if id(t.untyped_storage()) not in saved}
        return sum(s.nbytes() for s in saved.values()), sum(s.nbytes() for s in only_out.values())


@pytest.fixture(scope="module")
def runs():
    """(engine, DDP rank 0 at world size 2, oracle) for the CPU's SDPA and CUDA's."""
    spec = ParallelSpec(world_size=2, strategy="ddp")
    out = {}
    for sized in (None, "cuda"):
        engine = measure(_gpt2(sized), "fake", repeats=0)
        rank = measure_parallel(_gpt2(sized), spec, ranks=[0]).rank(0)
        out[sized] = (engine, rank, _oracle(sized == "cuda"))
    return out


def test_rank_splits_saved_and_outputs_as_the_engine_and_the_oracle(runs):
    """Both steps, to the byte: saved for backward 1,488,132 B (CPU SDPA) and 1,359,140 B (CUDA's
    memory-efficient kernel), kept by outputs only 288,772 B and 256,004 B (logits 256,000 B, the
    loss 4 B, and on the CPU the two layers' cached keys, 2 x 16,384 B)."""
    expected = {None: (1_488_132, 288_772), "cuda": (1_359_140, 256_004)}
    for sized, (engine, rank, oracle) in runs.items():
        assert (engine.saved_bytes, engine.output_bytes) == oracle == expected[sized], sized
        assert (rank.saved_for_backward_bytes, rank.output_bytes) == oracle, sized
        assert rank.saved_bytes == sum(oracle)  # the rank's one number: all forward leaves alive
        assert rank.as_dict()["saved_for_backward_bytes"] == oracle[0]
        assert rank.as_dict()["output_bytes"] == oracle[1]
    assert dict(runs["cuda"][1].attention_backends).keys() == {"memory-efficient"}


def test_cuda_sdpa_shifts_the_engine_and_the_rank_alike(runs):
    """The issue's numbers: sizing for CUDA shifts saved-for-backward by -128,992 B on both sides (and
    the oracle), the outputs by -32,768 B, and the rank's ``saved_bytes`` by their sum, -161,760 B."""
    (e0, r0, o0), (e1, r1, o1) = runs[None], runs["cuda"]
    assert e1.saved_bytes - e0.saved_bytes == r1.saved_for_backward_bytes - r0.saved_for_backward_bytes
    assert e1.saved_bytes - e0.saved_bytes == o1[0] - o0[0] == -128_992
    assert e1.output_bytes - e0.output_bytes == r1.output_bytes - r0.output_bytes == o1[1] - o0[1] == -32_768
    assert r1.saved_bytes - r0.saved_bytes == -161_760


def test_fsdp_under_autocast_shifts_alike():
    """The issue's autocast numbers (bf16, CUDA's flash kernel), FSDP2 at world size 2: saved for
    backward -14,288 B on both sides, outputs -32,768 B; the rank's one number -47,056 B."""
    spec = ParallelSpec(world_size=2, strategy="fsdp")
    engine, rank = [], []
    for sized in (None, "cuda"):
        wl = _gpt2(sized).replace(autocast_dtype=torch.bfloat16)
        engine.append(measure(wl, "fake", repeats=0))
        rank.append(measure_parallel(wl, spec, ranks=[0]).rank(0))
    assert dict(rank[1].attention_backends).keys() == {"flash"}
    shift = engine[1].saved_bytes - engine[0].saved_bytes
    assert rank[1].saved_for_backward_bytes - rank[0].saved_for_backward_bytes == shift == -14_288
    assert rank[1].output_bytes - rank[0].output_bytes == engine[1].output_bytes - engine[0].output_bytes == -32_768
    assert rank[1].saved_bytes - rank[0].saved_bytes == -47_056
    assert [r.saved_for_backward_bytes for r in rank] == [m.saved_bytes for m in engine]
