"""``optim`` names of bitsandbytes' optimizers read as the knobs that size their own layout
(``memsave_nb/optimizers_extra.py``), through the installed ``SFTConfig``, and back."""

from __future__ import annotations

import pytest

from memsave_nb import Plan
from memsave_nb.trainers import from_trainer, to_trainer

from .conftest import tiny_llama

trl = pytest.importorskip("trl")

NAMES = {
    "adamw_bnb_8bit": "adamw_8bit_embed32",  # optim_bits=8: the Trainer keeps nn.Embedding weights in 32 bits
    "adamw_8bit": "adamw_8bit_embed32",
    "paged_adamw_8bit": "adamw_8bit_embed32",
    "lion_32bit": "lion",
    "paged_lion_32bit": "lion",
    "lion_8bit": "lion_8bit_embed32",
    "paged_lion_8bit": "lion_8bit_embed32",
}


@pytest.mark.parametrize("optim", list(NAMES))
def test_bitsandbytes_optim_names_read_as_their_layout(optim):
    cfg = trl.SFTConfig(output_dir="/tmp/x", use_cpu=True, optim=optim)  # the installed class takes the name
    imported = from_trainer(cfg, tiny_llama())
    assert imported.plan.optimizer == NAMES[optim]
    assert not any("no knob sizes it" in n for n in imported.notes)
    assert any("upper bound" in n for n in imported.notes) == optim.startswith("paged_")


@pytest.mark.parametrize("knob", ["adamw_8bit_embed32", "lion", "lion_8bit_embed32"])
def test_the_knob_is_written_as_an_optim_that_reads_back(knob):
    plan = Plan(
        batch_size=2, seq_len=32, precision="autocast_bf16", optimizer=knob, accumulation_steps=1, loss="trl_cpu"
    )  # use_cpu: no GPU here
    exported = to_trainer(plan, "trl")
    back = from_trainer(trl.SFTConfig(output_dir="/tmp/x", **exported.fields))
    assert back.plan.optimizer == knob and back.plan.loss == "trl_cpu"
