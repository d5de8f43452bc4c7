"""Tied parameters are one parameter: it trains when any of its names is selected (trainable wins),
it is counted once, and plans, presets and the exported code agree with the gradients a step makes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memsave_nb import hf, presets
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload
from .real_cases import case_named, shared
from .real_steps import step_grads

WTE, HEAD = "transformer.wte.weight", "lm_head.weight"


class TiedLM(nn.Module):
    """A pure-torch model with an input/output embedding tie, declared in the head-first order."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 16, bias=False)
        self.embed = nn.Embedding(16, 8)
        self.embed.weight = self.head.weight
        self.body = nn.Linear(8, 8)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


@pytest.fixture(scope="module")
def gpt2():
    return shared(case_named("gpt2")).workload


def test_tied_parameters_of_any_module():
    assert hf.tied_parameters(TiedLM()) == {"head.weight": ("head.weight", "embed.weight")}
    assert hf.tied_parameters(nn.Linear(2, 2)) == {}
    model = TiedLM()
    assert list(hf.parameter_names(model)) == [n for n, _ in model.named_parameters()]


def test_tied_parameters_of_hugging_face_models(gpt2):
    assert hf.tied_parameters(gpt2.model) == {WTE: (WTE, HEAD)}
    t5 = shared(case_named("t5")).model
    assert hf.tied_parameters(t5) == {
        "shared.weight": (
            "shared.weight",
            "encoder.embed_tokens.weight",
            "decoder.embed_tokens.weight",
            "lm_head.weight",
        )
    }


def _requires_grad(model):
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_head_only_on_gpt2_trains_exactly_the_tied_embedding(gpt2):
    plan = presets.head_only(gpt2.model)
    assert plan.trainable == ("lm_head",)
    assert plan.name == f"head only ({HEAD} is tied to {WTE}, which trains too)"
    assert presets.presets_for(gpt2)["head only"].name == plan.name
    assert plan.trainable_parameter_names(gpt2.model) == [WTE]
    with plan.apply(gpt2) as applied:
        assert _requires_grad(applied.model) == [WTE]
        grads = step_grads(applied)
    assert list(grads) == [WTE]
    n_embedding = gpt2.model.transformer.wte.weight.numel()
    assert sum(g.numel() for g in grads.values()) == n_embedding == 128 * 64


@pytest.mark.parametrize("label", ["last quarter", "first quarter", "last block", "all trainable", "norm layers only"])
def test_preset_counts_match_the_gradients_a_step_makes(gpt2, label):
    plan = presets.presets_for(gpt2)[label]
    names = plan.trainable_parameter_names(gpt2.model)
    with plan.apply(gpt2) as applied:
        grads = step_grads(applied)
        flagged = _requires_grad(applied.model)
    assert names == flagged == list(grads)
    ties = label in ("last quarter", "first quarter", "all trainable")
    assert (WTE in names) == ties
    assert ("tied" in plan.name) == (label in ("last quarter", "first quarter"))


def test_last_quarter_on_gpt2_counts_the_tied_head():
    """The issue's numbers: 12-layer GPT-2, last quarter: 37 parameters get gradients, 37 reported."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=12, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    plan = presets.last_quarter(model)
    names = plan.trainable_parameter_names(model)
    assert len(names) == 37 and WTE in names
    ids = torch.zeros(1, 4, dtype=torch.long)
    with plan.apply(Workload(model, {"input_ids": ids, "labels": ids})) as wl:
        grads = step_grads(wl)
    assert list(grads) == names


@pytest.mark.parametrize(
    "plan, trains_embedding",
    [
        (Plan(frozen="*", trainable=["lm_head"]), True),  # any owner selected: trains
        (Plan(frozen="*", trainable=["transformer.wte"]), True),
        (Plan(frozen=["lm_head"]), False),  # frozen through any owner, no trainable name for it
        (Plan(frozen=["lm_head"], trainable=["transformer.wte"]), True),  # trainable wins
        (Plan(frozen="*", trainable=["transformer.h"]), False),
    ],
)
def test_one_rule_for_apply_names_and_exported_code(gpt2, plan, trains_embedding):
    names = plan.trainable_parameter_names(gpt2.model)
    assert (WTE in names) == trains_embedding
    assert HEAD not in names  # reported once, under its named_parameters() name
    with plan.apply(gpt2) as applied:
        assert _requires_grad(applied.model) == names
        assert list(step_grads(applied)) == names
    fresh = copy.deepcopy(gpt2.model)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    namespace = {"net": fresh}
    exec(compile(plan.to_code(model_var="net"), "<plan>", "exec", dont_inherit=True), namespace)
    assert _requires_grad(fresh) == names
