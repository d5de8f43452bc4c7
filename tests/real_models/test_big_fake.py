"""One full-size model in fake mode: GPT-2 small (124M parameters), batch 2, seq 1024, built under
FakeTensorMode (no memory), measured as it is and with SAC over its 12 blocks."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

GPT2_PARAMETERS = 124_439_808  # the published count, the tied embedding once


@pytest.mark.slow
def test_gpt2_small_in_fake_mode():
    transformers = pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    assert sum(p.numel() for p in model.parameters()) == GPT2_PARAMETERS
    ids = torch.zeros(2, 1024, dtype=torch.long)
    wl = Workload(model, {"input_ids": ids, "labels": ids}, optimizer=None)
    plain = measure(wl, "fake", flops=False)
    assert plain.peak_split.parameters == 4 * GPT2_PARAMETERS
    assert max(plain.timeline.by_category["gradients"]) == 4 * GPT2_PARAMETERS
    blocks = suggest_regions(model)
    assert blocks == [f"transformer.h.{i}" for i in range(12)]
    plan = Plan(regions={b: "save_matmuls" for b in blocks})  # the plan that crashed on the KV cache
    with plan.apply(wl) as applied:
        sac = measure(applied, "fake", flops=False)
    assert model.config.use_cache is True
    assert 0 < sac.saved_bytes < plain.saved_bytes
    assert sac.peak_bytes < plain.peak_bytes
