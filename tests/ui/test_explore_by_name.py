"""``explore(name, lora=..., seq_len=...)``: the explorer on a Hugging Face model by name (issue 26
section 3), in fake mode, on the same workload ``from_pretrained`` builds."""

from __future__ import annotations

import pytest

from memsave_nb import measure
from memsave_nb.errors import WorkloadError
from memsave_nb.hub import from_pretrained
from memsave_nb.ui.explorer import explore

SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    seq_len=32,
)


def test_explore_a_catalogue_model_by_name_in_fake_mode():
    ex = explore("llama-3.2-1b", lora=dict(r=4), live=False, repeats=0, **SMALL)
    try:
        assert ex.session.mode == "fake"
        assert "loop loss_only" in ex.title.value
        direct = measure(from_pretrained("llama-3.2-1b", lora=dict(r=4), **SMALL), mode="fake")
        assert ex.session.baseline.peak_bytes == direct.peak_bytes
    finally:
        ex.close()


def test_name_arguments_are_refused_where_they_cannot_apply():
    with pytest.raises(WorkloadError, match="demo model"):
        explore("mlp", lora=dict(r=4))
    with pytest.raises(WorkloadError, match="only with a model given by name"):
        explore(from_pretrained("llama-3.2-1b", **SMALL), lora=dict(r=4))
    with pytest.raises(WorkloadError, match="mode='fake'"):
        explore("llama-3.2-1b", mode="compiled", **SMALL)
