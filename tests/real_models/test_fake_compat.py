"""Fake mode reads the batch a real step reads: transformers' mask checks under SAC regions.

A Hugging Face decoder passes SDPA ``is_causal=True`` and no mask when its positions are consecutive
and its attention mask is all ones, and builds a (B, 1, T, T) bool mask otherwise, which checkpointed
regions keep. Fake tensors have no values; memsave_nb.measure.fake_compat answers from the real batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan

from .real_cases import BATCH, SEQ, VOCAB, case_named, shared

MASK_BYTES = BATCH * SEQ * SEQ  # one (B, 1, T, T) bool mask


def _batch(variant: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))  # (B, T)
    batch = {"input_ids": ids, "labels": ids}
    if variant == "full-mask":  # (the batch without mask or positions is in test_real_fake.py)
        batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
    elif variant == "padded-mask":
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -3:] = 0
        batch["attention_mask"] = mask
    elif variant == "consecutive-positions":
        batch["position_ids"] = torch.arange(SEQ).expand(BATCH, SEQ).clone()
    elif variant == "packed-positions":  # two sequences of T/2 in each row
        batch["position_ids"] = torch.arange(SEQ // 2).repeat(2).expand(BATCH, SEQ).clone()
    return batch


def _measure_under_sac(workload, mode: str):
    plan = Plan(regions={b: "save_matmuls" for b in suggest_regions(workload.model)})
    with plan.apply(workload) as applied:
        return measure(applied, mode, repeats=0, flops=False)


@pytest.mark.slow
def test_fake_equals_real_whichever_mask_path_the_batch_picks():
    llama = shared(case_named("llama")).workload
    saved = {}
    for variant in ("full-mask", "padded-mask", "consecutive-positions", "packed-positions"):
        workload = llama.replace(batch=_batch(variant))
        real = _measure_under_sac(workload, "real")
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # every value was known: no over-count warning
            fake = _measure_under_sac(workload, "fake")
        assert (fake.peak_bytes, fake.saved_bytes, fake.peak_split) == (
            real.peak_bytes,
            real.saved_bytes,
            real.peak_split,
        ), variant
        saved[variant] = real.saved_bytes
    # both paths were taken: the batches that make a real step build the mask keep exactly one more
    assert saved["padded-mask"] - saved["full-mask"] == MASK_BYTES
    assert saved["packed-positions"] - saved["consecutive-positions"] == MASK_BYTES


def test_unknown_mask_values_warn_with_the_bytes_fake_mode_over_counts():
    """At a larger shape, fake mode only: a batch factory's mask has no values to read; the warning's
    byte count is the measured difference to the same batch given as real tensors (B*T*T)."""
    from transformers import masking_utils

    originals = (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa)
    llama = shared(case_named("llama")).workload
    batch_size, seq = 4, 128

    def make() -> dict[str, torch.Tensor]:  # called by measure() inside the fake mode
        ids = torch.zeros(batch_size, seq, dtype=torch.long)
        # all ones, but read from the ids (a mask made by torch.ones is known to be full: not this test)
        return {"input_ids": ids, "labels": ids, "attention_mask": (ids == 0).long()}

    known = llama.replace(batch=make())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fake_known = _measure_under_sac(known, "fake")
    with pytest.warns(UserWarning, match=rf"over-count by {batch_size * seq * seq} bytes") as caught:
        fake_unknown = _measure_under_sac(llama.replace(batch=make), "fake")
    assert len([w for w in caught if "over-count" in str(w.message)]) == 1
    assert fake_unknown.saved_bytes - fake_known.saved_bytes == batch_size * seq * seq
    assert (masking_utils.find_packed_sequence_indices, masking_utils._ignore_causal_mask_sdpa) == originals


def _bart():
    from .real_cases import HEADS, HIDDEN, LAYERS, _transformers

    t = _transformers()
    cfg = t.BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=2 * HIDDEN,
        decoder_ffn_dim=2 * HIDDEN,
        max_position_embeddings=2 * SEQ,
    )
    torch.manual_seed(0)
    return t.BartForConditionalGeneration(cfg).train()


@pytest.mark.parametrize("mask", ["none", "padded", "full"])
def test_bart_in_fake_mode_equals_real_without_a_warning(mask):
    """BART's decoder makes its own all-ones attention_mask (torch.ones) when the batch has none:
    fake mode once built the decoder's mask a real step skips (16,384 bytes over, and a warning of
    2,048 without a mask; silently with a padded encoder mask). The ones it made are now known."""
    from memsave_nb.workload import Workload

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    if mask != "none":
        batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        if mask == "padded":
            batch["attention_mask"][1, SEQ // 2 :] = 0
    wl = Workload(_bart(), batch)
    real = measure(wl, "real", repeats=0, flops=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fake = measure(wl, "fake", repeats=0, flops=False)
    assert (fake.saved_bytes, fake.peak_bytes) == (real.saved_bytes, real.peak_bytes)
