"""Issue 38, item 1: ``loss="chunked"`` gives the model's own loss and gradients, or refuses.

Per family (every causal-LM model type of the catalogue, built from its catalogue config shrunk
to a few layers, and Gemma, Gemma 3, Cohere, Granite, Mixtral with the router loss on and off),
in float64 with some labels -100 and a chunk of 5 tokens (several chunks), the chunked step's loss
and every parameter's gradient equal

- the model's own logits (its forward, soft-capping and scaling included) through a float64
  next-token cross-entropy, plus ``router_aux_loss_coef * aux_loss`` the model returns: within
  1e-12 (loss) and 1e-10 (gradients, relative to the largest; 1e-6 for Cohere, whose layer
  norms compute in float32);
- the model's own ``model(..., labels=labels).loss`` (Hugging Face widens its logits to float32
  only): within 1e-6 relative, gradients within 1e-5 of the largest.

The head's weights are scaled up so that the logits reach the soft-cap (Gemma 2's 30) and the
scaled families' plain loss differs from theirs by more than 0.05 (asserted: the test can fail).
Masked LMs and encoder-decoders are refused in one line, the model left as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memsave_nb import Plan, Workload
from memsave_nb.errors import PlanError
from memsave_nb.hub.configs import catalogue, config_class
from memsave_nb.layers.linear_ce import chunked_linear_cross_entropy
from memsave_nb.loss import causal_lm

V = 97
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": V,
    "max_position_embeddings": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
SHRINK = {  # catalogue model_type -> the fields that make it tiny
    "llama": TINY,
    "qwen2": TINY,
    "qwen3": TINY,
    "mistral": TINY,
    "gemma2": {**TINY, "sliding_window": 16, "query_pre_attn_scalar": 8},
    "phi3": {**TINY, "original_max_position_embeddings": 64},
    "gpt2": {
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "vocab_size": V,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
}
EXTRA = {  # families outside the catalogue whose forward changes the logits or the loss
    "gemma": ("gemma", {**TINY}),
    "gemma3": (
        "gemma3_text",
        {**TINY, "sliding_window": 16, "query_pre_attn_scalar": 8, "final_logit_softcapping": 3.0},
    ),
    "cohere": ("cohere", {**TINY, "logit_scale": 4.0}),
    "granite": ("granite", {**TINY, "logits_scaling": 0.25}),
    "mixtral-router": (
        "mixtral",
        {
            **TINY,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
            "experts_implementation": "eager",
        },
    ),  # grouped_mm has no CPU float64
    "mixtral": (
        "mixtral",
        {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"},
    ),
}


def _causal_catalogue() -> dict[str, tuple[str, dict]]:
    """The first catalogue entry of each model type the hub builds as a causal LM."""
    from memsave_nb.hub.configs import from_catalogue
    from memsave_nb.hub.load import pick_task

    out: dict[str, tuple[str, dict]] = {}
    for name, entry in catalogue().items():
        if name.startswith("_") or entry["model_type"] in {t for t, _ in out.values()}:
            continue
        if pick_task(from_catalogue(name), None) == "causal-lm":
            out[name] = (entry["model_type"], {**entry["config"], **SHRINK.get(entry["model_type"], {})})
    return out


CATALOGUE = _causal_catalogue()
CASES = {**CATALOGUE, **EXTRA}


def test_every_causal_family_of_the_catalogue_is_shrunk_and_allowed():
    assert {t for t, _ in CATALOGUE.values()} == set(SHRINK)  # a new family needs its tiny config here
    assert {"gemma-2-2b", "gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b", "phi-3.5-mini"} <= set(
        CATALOGUE
    )


def _model(case: str) -> torch.nn.Module:
    model_type, fields = CASES[case]
    cfg = config_class(model_type)(**fields)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()  # eval: no dropout; grads still flow
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)  # logits of tens: the soft-cap and scales matter
    return model


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding
    labels[1, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _reference(model, batch) -> torch.Tensor:
    """Float64 next-token cross-entropy of the model's own logits, plus its router loss."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits, labels = out.logits, batch["labels"]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def _close(ours, theirs, rel):
    for name, a, b in zip(*ours, theirs):
        torch.testing.assert_close(
            a, b, rtol=0, atol=rel * b.abs().max().item() + 1e-300, msg=lambda m, name=name: f"{name}: {m}"
        )


def _own_and_chunked(model, batch):
    """(the model's own loss and gradients, the chunked knob's loss and gradients) on ``batch``,
    with ``loss_chunk=5`` (several chunks); the model put back after."""
    params = list(model.parameters())
    own = model(**batch).loss  # the model's own loss (float32 cross-entropy inside)
    g_own = torch.autograd.grad(own, params)
    with Plan(loss="chunked", loss_chunk=5).apply(Workload(model, batch)) as w:
        ours = w.forward(w.make_batch()).loss
        g_ours = torch.autograd.grad(ours, params)
    assert "forward" not in vars(model)  # put back
    return (own, g_own), (ours, g_ours)


def _equal_to_the_models_own(model, own, ours):
    """The chunked loss and gradients against the model's own, to float32's cross-entropy."""
    torch.testing.assert_close(ours[0].float(), own[0].float(), rtol=1e-6, atol=0)
    _close((dict(model.named_parameters()), ours[1]), own[1], 1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_and_gradients_equal_the_models_own_float64(case):
    model = _model(case)
    batch = _batch()
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}

    ref = _reference(model, batch)
    g_ref = torch.autograd.grad(ref, list(params.values()))
    own, (ours, g_ours) = _own_and_chunked(model, batch)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())

    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    # Cohere's layer norm computes in float32 whatever the model's dtype: last-bit differences of the
    # gradient coming into the backbone round to float32 there (seen: 1.2e-7 of the largest)
    _close((params, g_ours), g_ref, 1e-6 if case == "cohere" else 1e-10)
    _equal_to_the_models_own(model, own, (ours, g_ours))


@pytest.mark.parametrize(
    "case, transform",
    [
        ("gemma-2-2b", {"softcap": 30.0}),
        ("gemma3", {"softcap": 3.0}),
        ("cohere", {"logit_scale": 4.0}),
        ("granite", {"logit_scale": 4.0}),
    ],
)
def test_the_transform_is_read_and_matters(case, transform):
    """The family's head transform is the one its config says, and leaving it out would change
    the loss by more than 0.05 (so the equality above can fail)."""
    model = _model(case)
    _, head, found = causal_lm(model)
    assert {k: getattr(found, k) for k in transform} == transform
    batch = _batch()
    hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    plain = chunked_linear_cross_entropy(hidden[:, :-1], head.weight, batch["labels"][:, 1:], chunk=5)
    assert abs(plain.item() - _reference(model, batch).item()) > 0.05


def test_router_loss_matters():
    """Mixtral with ``output_router_logits``: the router term (coefficient 0.5) is in the loss."""
    model = _model("mixtral-router")
    batch = _batch()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert 0.5 * out.aux_loss.item() > 0.05
    assert causal_lm(model)[2].router_aux


@pytest.mark.parametrize(
    "cls_name, words",
    [
        ("BertForMaskedLM", "BertForMaskedLM is a masked LM"),
        ("ModernBertForMaskedLM", "ModernBertForMaskedLM is a masked LM"),
        ("BartForConditionalGeneration", "is an encoder-decoder"),
        ("T5ForConditionalGeneration", "is an encoder-decoder"),
        ("WhisperForConditionalGeneration", "is an encoder-decoder"),
        ("BertLMHeadModel", "has not checked"),
    ],
)
def test_refused_in_one_line_before_the_step(cls_name, words):
    import transformers

    cfgs = {
        "Bert": transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=V,
            is_decoder=True,
        ),
        "ModernBert": transformers.ModernBertConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=V,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            cls_token_id=0,
            sep_token_id=0,
        ),
        "Bart": transformers.BartConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            vocab_size=V,
        ),
        "T5": transformers.T5Config(d_model=32, d_ff=48, d_kv=8, num_layers=1, num_heads=4, vocab_size=V),
        "Whisper": transformers.WhisperConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            vocab_size=V,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            decoder_start_token_id=0,
        ),
    }
    prefix = next(p for p in sorted(cfgs, key=len, reverse=True) if cls_name.startswith(p))
    model = getattr(transformers, cls_name)(cfgs[prefix])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"input_ids": torch.randint(1, V, (1, 8)), "labels": torch.randint(1, V, (1, 8))}
    with pytest.raises(PlanError, match=words) as err:
        with Plan(loss="chunked").apply(Workload(model, batch)):
            pytest.fail("the plan applied")
    text = str(err.value)
    assert "\n" not in text and len(text) <= 200 and "loss='full'" in text
    assert "forward" not in vars(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_subclass_is_refused():
    """A subclass of an allowed class may change the forward: not on the list."""
    from transformers import LlamaForCausalLM

    class Mine(LlamaForCausalLM):
        pass

    with pytest.raises(PlanError, match="Mine is a subclass of LlamaForCausalLM"):
        causal_lm(Mine(config_class("llama")(**TINY)))


def test_report_refuses_bert_in_one_line(capsys):
    from memsave_nb.cli import main

    code = main(["report", "--model", "bert-base", "--loss", "chunked", "--seq-len", "16", "--batch", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "masked LM" in err and len(err) <= 220


def test_exported_snippet_gives_the_same_loss():
    """``to_code``'s ``use_chunked_loss`` line, exec'd on a fresh Gemma 2 (soft-capped), gives the
    plan's loss."""
    model = _model("gemma-2-2b")
    batch = _batch()
    ref = _reference(model, batch)
    code = Plan(loss="chunked", loss_chunk=5).to_code()
    assert "use_chunked_loss(model, chunk=5)" in code
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"model": model})
    try:
        torch.testing.assert_close(model(**batch).loss, ref, rtol=0, atol=1e-12)
    finally:
        model.__dict__.pop("forward", None)


def test_a_fully_sharded_model_is_still_its_family():
    """``fully_shard`` swaps the class for ``FSDP<Name>`` (hooks, no forward of its own): the
    allow-list sees through it (the layout search shards the model before the loss knob)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = fully_shard(_model("gemma-2-2b"))
        assert type(model).__name__ == "FSDPGemma2ForCausalLM"
        assert causal_lm(model)[2].softcap == 30.0
    finally:
        dist.destroy_process_group()


def test_the_planner_leaves_the_knob_out_on_a_masked_lm():
    import transformers

    from memsave_nb.planner.what_fits import what_would_fit
    from memsave_nb.target import Target

    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, vocab_size=V
    )
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(1, V, (2, 8))
    hints = what_would_fit(Workload(model, {"input_ids": ids, "labels": ids.clone()}), Plan(), Target(1), gpus=False)
    assert hints and "loss" not in {h.knob for h in hints}


@pytest.mark.parametrize("extra", ["num_items_in_batch", "shift_labels"])
def test_trainer_keywords_are_the_models_own(extra):
    """Hugging Face's Trainer passes ``num_items_in_batch`` (sum over the kept positions, divided by
    it: gradient accumulation); ``shift_labels`` replaces the shift by one. Same loss and gradients
    as the model's own (float32 cross-entropy inside), on a soft-capped Gemma 2."""
    model = _model("gemma-2-2b")
    batch = _batch()
    if extra == "num_items_in_batch":
        batch[extra] = torch.tensor(23)  # more than this micro-batch's 12 kept positions
    else:
        batch[extra] = torch.roll(batch["labels"], 2, dims=1)  # aligned with the positions (labels still needed)
    own, ours = _own_and_chunked(model, batch)
    _equal_to_the_models_own(model, own, ours)
    if extra == "num_items_in_batch":
        assert abs(ours[0].item() - 12 / 23 * _reference(model, {k: v for k, v in batch.items() if k != extra})) < 1e-9
