"""A rank step sized for CUDA under autocast follows CUDA's op lists, as the single-GPU engine's does
(issue 40 part 2). Oracle: the engine's own fake-mode step, whose lists are checked against the
installed torch's registrations and hand-written casts in ``tests/measure/test_cuda_autocast.py``."""

from __future__ import annotations

import pytest
import torch

from memsave_nb import measure
from memsave_nb.measure import cuda_autocast as ca
from memsave_nb.parallel import ParallelSpec, measure_parallel
from tests.measure import hf_models


def _gpt2(sized_for):
    """GPT-2 (2 layers, batch 2, 32 tokens, d 64) under bf16 autocast, eager attention: sized_for then
    changes autocast's lists only (SDPA's backend choice would change the saved bytes as well)."""
    w = hf_models.gpt2(layers=2, d=64).replace(autocast_dtype=torch.bfloat16, optimizer="none", sized_for=sized_for)
    w.model.set_attn_implementation("eager")
    return w


@pytest.fixture(scope="module")
def engine_delta() -> int:
    cpu = measure(_gpt2(None), "fake", repeats=0)
    cuda = measure(_gpt2("cuda"), "fake", repeats=0)
    return cuda.saved_bytes - cpu.saved_bytes


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank_saves_what_the_engine_adds_under_cuda_lists(strategy, engine_delta):
    """gelu_new's pow (and the norms, eager softmax, the loss's log_softmax) in fp32 on CUDA: the
    rank's saved bytes grow by the engine's difference, to the byte (196,608 B; the tanh alone is
    131,072 B against the CPU's 65,536 B)."""
    spec = ParallelSpec(world_size=2, strategy=strategy)
    cpu = measure_parallel(_gpt2(None), spec, ranks=[0]).rank(0)
    cuda = measure_parallel(_gpt2("cuda"), spec, ranks=[0]).rank(0)
    assert cuda.saved_bytes - cpu.saved_bytes == engine_delta == 196_608
    # the tracked step's calls only (DDP's whole first step ran under the lists too, uncounted)
    ops = dict(cuda.autocast_ops)
    assert ops["pow.Tensor_Scalar"] == 2 and ops["layer_norm"] == 5 and ops["softmax.int"] == 2
    assert cuda.as_dict()["autocast_ops"] == ops
    assert cpu.autocast_ops == () and cpu.as_dict()["autocast_ops"] == {}
    assert ca._USERS == [0] and not ca._LIBRARY  # autocast's own CPU kernels are back
