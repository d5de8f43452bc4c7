"""The HF Trainer's 8-bit bitsandbytes optimizers keep every ``nn.Embedding`` weight's state in 32
bits (``create_optimizer`` registers ``{"optim_bits": 32}`` with bitsandbytes' ``GlobalOptimManager``):
a config with such an ``optim`` is sized that way, to the byte of what the real Trainer's optimizer
allocates in one ``step()`` on this CPU, and the CLI prints the higher number."""

from __future__ import annotations

import json
import tempfile
import warnings

import pytest
import torch

from memsave_nb import Plan, Workload, cli
from memsave_nb.optimizers_extra import LayoutOptimizer
from memsave_nb.trainers import from_trainer, hf
from memsave_nb.units import format_bytes

from .steady import optimizer_state_bytes, tiny

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

VOCAB, HIDDEN = 512, 64  # embedding 32,768 elements: 8-bit blocks unless overridden; norms stay float32


def _state(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, tuple[int, set[torch.dtype], bool]]:
    """Per parameter name (the Trainer orders its groups by weight decay): (state bytes without the
    shared maps, their dtypes, whether it has an absmax)."""
    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and not k.startswith("qmap")}
        out[name] = (sum(t.nbytes for t in tensors.values()), {t.dtype for t in tensors.values()}, "absmax1" in st)
    return out


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _trainer_optimizer(optim: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", optim=optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' kernel loader on CPU
        return transformers.Trainer(model=model, args=args).create_optimizer()


@pytest.mark.parametrize(
    "optim, knob", [("adamw_bnb_8bit", "adamw_8bit_embed32"), ("paged_lion_8bit", "lion_8bit_embed32")]
)
def test_the_trainers_bitsandbytes_state_equals_ours_to_the_byte(optim, knob):
    theirs_model = tiny("llama", VOCAB, hidden=HIDDEN)
    theirs = _trainer_optimizer(optim, theirs_model)
    embed = theirs_model.get_input_embeddings().weight
    registered = bnb.optim.GlobalOptimManager.get_instance().module_weight_config_triple
    assert any(getattr(m, a) is embed and c == {"optim_bits": 32} for m, a, c in registered)
    _step(theirs_model, theirs)

    model = tiny("llama", VOCAB, hidden=HIDDEN)
    imported = from_trainer({"optim": optim}, model, trainer="hf")
    assert imported.plan.optimizer == knob
    with imported.plan.apply(Workload(model, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})) as w:
        ours = w.make_optimizer()
        _step(model, ours)
    assert _state(ours, model) == _state(theirs, theirs_model)  # parameter by parameter: bytes, dtypes, absmax or not
    assert optimizer_state_bytes(ours) == optimizer_state_bytes(theirs)
    moments = 2 if knob.startswith("adamw") else 1
    # the embedding (and a tied head) at 32 bits: moments x 4 bytes per element, no absmax
    assert _state(ours, model)["model.embed_tokens.weight"] == (moments * 4 * VOCAB * HIDDEN, {torch.float32}, False)
    assert _state(ours, model)["model.layers.0.mlp.up_proj.weight"][1:] == ({torch.uint8, torch.float32}, True)
    # the plain 8-bit knob is lower by exactly the gap the reader's note prints
    with Plan(optimizer=knob.removesuffix("_embed32")).apply(
        Workload(model, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    ) as w:
        plain = w.make_optimizer()
        _step(model, plain)
    gap = hf.embedding_gap(knob, model)
    assert gap == moments * (4 * VOCAB * HIDDEN - (VOCAB * HIDDEN + 4 * VOCAB * HIDDEN // 256)) > 0
    assert optimizer_state_bytes(plain) + gap == optimizer_state_bytes(theirs)
    assert sum(f"{gap:,} B above 8 bits" in n and "sized" in n for n in imported.notes) == 1


def test_master_copies_of_embeddings_keep_32_bit_state():
    """bf16_master: the layout optimizer steps fp32 copies; the embedding's copy is the one kept at 32 bits."""
    model = tiny("llama", VOCAB, hidden=HIDDEN)
    plan = Plan(optimizer="adamw_8bit_embed32", precision="bf16_master")
    with plan.apply(Workload(model, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})) as w:
        opt = w.make_optimizer()
        _step(model, opt)
    inner = opt._inner
    assert isinstance(inner, LayoutOptimizer)
    embed_state = opt.state[model.get_input_embeddings().weight]
    assert embed_state["state1"].dtype == torch.float32 and "absmax1" not in embed_state
    big = [p for p in model.parameters() if p.numel() >= 4096 and p is not model.get_input_embeddings().weight]
    assert big and all(opt.state[p]["state1"].dtype == torch.uint8 for p in big)


def test_the_cli_prints_the_trainers_optimizer_state(capsys, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    fields = tmp_path / "fields.json"
    fields.write_text(json.dumps({"per_device_train_batch_size": 2, "optim": "adamw_bnb_8bit"}))
    assert cli.main(["report", "--model", str(folder), "--seq-len", "32", "--from-config", str(fields)]) == 0
    out = capsys.readouterr().out
    printed = " ".join(next(x for x in out.splitlines() if x.startswith("optimizer state")).split()[2:4])
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    theirs = _trainer_optimizer("adamw_bnb_8bit", model)
    _step(model, theirs)
    with Plan(optimizer="adamw_8bit").apply(
        Workload(model, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    ) as w:
        plain = w.make_optimizer()
        _step(model, plain)
    assert (
        optimizer_state_bytes(theirs) - optimizer_state_bytes(plain) == hf.embedding_gap("adamw_8bit", model) == 195_584
    )
    assert printed == format_bytes(optimizer_state_bytes(theirs)) != format_bytes(optimizer_state_bytes(plain))


def test_the_exported_code_keeps_the_embedding_at_32_bits_as_sized():
    """Plan.to_code() registers the Trainer's override: its optimizer's state is the knob's, to the byte."""
    model = tiny("llama", VOCAB, hidden=HIDDEN)
    scope: dict = {"model": model}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' kernel loader on CPU
        exec(Plan(optimizer="adamw_8bit_embed32").to_code(), scope)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    scope["training_step"](model, [{"input_ids": ids, "labels": ids}], scope["optimizer"])
    twin = tiny("llama", VOCAB, hidden=HIDDEN)
    with Plan(optimizer="adamw_8bit_embed32").apply(
        Workload(twin, batch={"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    ) as w:
        ours = w.make_optimizer()
        _step(twin, ours)
    assert _state(scope["optimizer"], model) == _state(ours, twin)
    assert _state(ours, twin)["model.embed_tokens.weight"][1:] == ({torch.float32}, False)
