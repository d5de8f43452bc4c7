"""HF's ``activation_checkpointing_kwargs={"offload": True}`` is each layer checkpointed inside
``save_on_cpu`` (transformers 5.25 ``_activation_checkpointing_enable``): what goes to the host is
what a checkpoint saves through the outer hooks, the layer's input. Read as ``full_offload`` regions,
held here to transformers' own checkpointing with its ``save_on_cpu`` counted."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memsave_nb import Plan, Workload, measure
from memsave_nb.checkpointing import RegionKind
from memsave_nb.trainers import from_trainer, to_trainer

from .conftest import LAYERS, VOCAB, tiny_llama

B, T, D = 2, 16, 32  # tiny_llama's hidden size
LAYER_NAMES = [f"model.layers.{i}" for i in range(LAYERS)]
FIELDS = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"offload": True}}


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _transformers_moves() -> list[int]:
    """Bytes each ``save_on_cpu`` pack moves in one forward of transformers' own offloading checkpoint
    (the same hooks, counting instead of copying: this CPU has no pinned memory)."""
    moved: list[int] = []

    @contextlib.contextmanager
    def counting_save_on_cpu(pin_memory: bool = False, device_type: str = "cuda"):
        def pack(t: torch.Tensor) -> torch.Tensor:
            with _disable_current_modes():
                moved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    model = tiny_llama()
    with mock.patch("transformers.modeling_utils.save_on_cpu", counting_save_on_cpu):
        model.activation_checkpointing_enable(offload=True)
        model(**_batch()).loss.backward()
    return moved


def test_the_trainers_offload_switch_reads_as_full_offload_and_moves_what_transformers_moves():
    got = from_trainer(FIELDS, tiny_llama())
    assert sorted(got.plan.regions) == LAYER_NAMES
    assert {p.kind for p in got.plan.regions.values()} == {RegionKind.FULL_OFFLOAD}
    assert any("save_on_cpu" in n for n in got.notes)

    theirs = _transformers_moves()
    assert theirs == [B * T * D * 4] * LAYERS  # one layer input each: 4,096 B, nothing else
    wl = Workload(model=tiny_llama(), batch=_batch(), optimizer="sgd")
    with Plan(regions=got.plan.regions).apply(wl) as w:  # the regions only: the Trainer's default batch is 8
        ours = measure(w, mode="real", repeats=0)
    assert ours.host.to_host_bytes == ours.host.peak_bytes == sum(theirs) == 16_384
    assert ours.host.tensors == len(theirs)


def test_plain_offload_regions_are_not_written_for_the_trainer_and_full_offload_round_trips():
    model = tiny_llama()
    plain = to_trainer(Plan(regions={n: "offload" for n in LAYER_NAMES}), "hf", model=model)
    assert "activation_checkpointing_kwargs" not in plain.fields
    assert any("the Trainer cannot offload without checkpointing" in n for n in plain.notes)
    full = to_trainer(Plan(regions={n: "full_offload" for n in LAYER_NAMES}), "hf", model=model)
    assert full.fields["activation_checkpointing_kwargs"]["offload"] is True
    assert from_trainer(full.fields, model).plan.regions == {
        n: Plan(regions={n: "full_offload"}).regions[n] for n in LAYER_NAMES
    }
