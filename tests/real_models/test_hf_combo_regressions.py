"""Regressions found by the random plans on Hugging Face models (test_hf_plan_property.py), minimised."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.measure import measure
from memsave_nb.plan import Plan

from .hf_plans import Checker, Outcome, build


@pytest.mark.slow
def test_seq_len_cuts_inputs_embeds_with_the_labels():
    """A batch of ``inputs_embeds`` (B, T, H) and labels: ``seq_len`` cut the labels only, and the
    step failed in the model's loss ("Expected input batch_size (16) to match target batch_size (8)")."""
    wl = build("gpt2", torch.float64, embeds=True)
    for n in (4, 12):  # cut, and tiled then cut
        with Plan(seq_len=n, regions={"transformer.h.0": "save_matmuls"}).apply(wl) as applied:
            batch = applied.make_batch()  # a tiled batch is built when asked (fake under fake mode)
            assert {k: tuple(v.shape[:2]) for k, v in batch.items()} == {"inputs_embeds": (2, n), "labels": (2, n)}
            del batch
            real = measure(applied, "real", repeats=0, flops=False, steady_state=False)
            fake = measure(applied, "fake", flops=False, steady_state=False)
        assert (real.peak_bytes, real.saved_bytes, real.peak_split) == (
            fake.peak_bytes,
            fake.saved_bytes,
            fake.peak_split,
        )
    # and the gradients are plain PyTorch's on the cut batch
    outcome = Outcome()
    Checker("gpt2").check(
        {"seq_len": 4, "memsave": ["*"], "regions": {"transformer.h.1": "full"}}, outcome, embeds=True
    )
    assert outcome.compared == 1 and outcome.compared_tensors == len(list(wl.model.parameters()))


@pytest.mark.slow
def test_precision_knobs_meet_regions_on_llama():
    """bf16 master weights with Adafactor and an offloaded block, autocast with a selective block,
    accumulation with both: the combinations the knob tests and the region tests each miss."""
    outcome = Outcome()
    checker = Checker("llama")
    blocks = ["model.layers.0", "model.layers.1"]
    for fields in (
        {"precision": "bf16_master", "optimizer": "adafactor", "regions": {blocks[0]: "offload"}},
        {"precision": "autocast_bf16", "regions": {blocks[1]: "save_matmuls"}, "accumulation_steps": 2},
        {
            "precision": "bf16",
            "regions": {blocks[0]: "full", blocks[1]: "offload"},
            "batch_size": 3,
            "set_to_none": False,
        },
    ):
        checker.check(fields, outcome, steady_state=True)
    assert outcome.compared == 3, outcome
