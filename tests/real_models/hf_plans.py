"""Random plans over tiny Hugging Face models, where the choices meet: freezing presets x
memory-saving layers x regions (full, selective with a random per-op policy, offload) x workload
knobs (batch size, sequence length, accumulation, precision, optimizer, set_to_none).

Used by ``test_hf_plan_property.py``. A seeded generator (not hypothesis): every CI run checks the
same plans, and a failure prints the plan's JSON to replay it with :meth:`Checker.check`.

The oracle is plain PyTorch on the same model, with no plan: every parameter trainable, the batch
resized by hand (``ids[:n]``, or tiled then cut), ``k`` micro-batches of ``loss / k`` for
accumulation, ``torch.autocast`` or a bf16 copy of the model for precision, the same seed (dropout
draws the same masks). The plan's gradients are read where the engine's optimizer sees them (a
global optimizer-step pre-hook), from ``measure(..., "real")``: the path a user's measurement takes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

from memsave_nb.checkpointing import POLICY_PRESETS, PlanError  # noqa: E402
from memsave_nb.knobs import KNOB_FIELDS  # noqa: E402
from memsave_nb.measure import measure  # noqa: E402
from memsave_nb.model_state import ModelSnapshot  # noqa: E402
from memsave_nb.plan import Plan  # noqa: E402
from memsave_nb.presets import presets_for  # noqa: E402
from memsave_nb.workload import Workload  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH, POSITIONS = 32, 16, 2, 2, 8, 2, 16
SEED = 7


# -- models (tiny: one plan must take a fraction of a second) --------------------------------------
def _transformers():
    t = pytest.importorskip("transformers", reason="transformers is not installed (test extra)")
    t.logging.set_verbosity_error()
    return t


def _gpt2() -> nn.Module:
    """GPT-2 with a ReLU MLP (a memory-saving layer inside every block) and dropout 0.1."""
    t = _transformers()
    cfg = t.GPT2Config(
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        activation_function="relu",
        bos_token_id=0,
        eos_token_id=0,
    )
    return t.GPT2LMHeadModel(cfg)


def _llama_config(t, act: str):
    return t.LlamaConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=POSITIONS,
        hidden_act=act,
        attention_dropout=0.1,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def _llama() -> nn.Module:
    """Llama (GQA, RMSNorm, SiLU-gated MLP, attention dropout 0.1)."""
    return _transformers().LlamaForCausalLM(_llama_config(_transformers(), "silu"))


def _lora_llama() -> nn.Module:
    """A peft LoRA Llama (ReLU6 MLP, LoRA dropout 0.1: both memory-saving layers) with non-zero B."""
    t = _transformers()
    peft = pytest.importorskip("peft", reason="peft is not installed (test extra)")
    base = t.LlamaForCausalLM(_llama_config(t, "relu6"))
    cfg = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "up_proj"])
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _t5() -> nn.Module:
    t = _transformers()
    cfg = t.T5Config(
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=2 * HIDDEN,
        num_heads=HEADS,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        relative_attention_num_buckets=8,
    )
    return t.T5ForConditionalGeneration(cfg)


BUILDERS: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "llama": _llama, "lora-llama": _lora_llama, "t5": _t5}
MODELS = tuple(BUILDERS)


EMBEDS_MODELS = ("gpt2", "llama")  # also run from float inputs_embeds (the input can require grad)


def _batch(name: str, embeds: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)  # (B, T)
    if embeds:
        return {"inputs_embeds": torch.randn(BATCH, SEQ, HIDDEN, generator=g), "labels": ids}  # (B, T, H)
    if name == "t5":  # labels of another length: seq_len resizes both (both are token keys)
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=g)}
    return {"input_ids": ids, "labels": ids.clone()}


def build(name: str, dtype: torch.dtype, embeds: bool = False) -> Workload:
    """The model in ``dtype`` with seeded weights, in train mode, and its batch (token ids, or
    ``inputs_embeds`` in ``dtype``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BUILDERS[name]().to(dtype)
    model.train()
    batch = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _batch(name, embeds).items()}
    return Workload(model, batch, name=f"{name}-{str(dtype).split('.')[-1]}{'-embeds' * embeds}")


# -- random plans --------------------------------------------------------------------------------
# ops a custom selective policy may name: HF decoders run most of them
OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten.native_layer_norm",
    "aten.relu",
    "aten.hardtanh",
    "aten.silu",
    "aten.mul",
    "aten.add",
    "aten.native_dropout",
    "aten.bernoulli",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._softmax",
    "aten.rsqrt",
    "aten.mean",
    "aten.pow",
    "aten.embedding",
    "aten.cat",
    "aten.neg",
    "aten.cos",
    "aten.sin",
    "aten.clone",
    "aten.view",
    "aten.t",
    "aten._log_softmax",
    "aten.where",
    "aten.div",
)
PRECISIONS = ("autocast_bf16", "autocast_fp16", "bf16", "bf16_master")
OPTIMIZERS = ("adamw", "adamw_foreach", "adamw_fused", "sgd", "sgd_momentum", "adafactor")
AUTOCAST = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}


def random_policy(rng: random.Random) -> Any:
    kind = rng.choice(["preset", "full", "offload", "selective", "selective", "selective"])
    if kind == "preset":
        return rng.choice(sorted(POLICY_PRESETS))
    if kind in ("full", "offload"):
        return {"kind": kind}
    ops = {op: rng.choice(["save", "recompute"]) for op in rng.sample(OPS, rng.randint(0, 5))}
    return {"kind": "selective", "ops": ops, "default": rng.choice(["save", "recompute"])}


def _region_candidates(model: nn.Module) -> list[str]:
    """Blocks and their big parts (attention, MLP, norms), the embedding and the head: what a user
    checkpoints. Containers (ModuleList) are never called, so they are left out."""
    out = []
    for n, m in model.named_modules():
        if not n or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            continue
        leaf = n.rsplit(".", 1)[-1]
        if leaf.isdigit() or leaf in (
            "attn",
            "self_attn",
            "mlp",
            "ln_1",
            "ln_2",
            "input_layernorm",
            "layer",
            "wte",
            "embed_tokens",
            "lm_head",
            "DenseReluDense",
            "SelfAttention",
        ):
            out.append(n)
    return out


def random_plan(rng: random.Random, model: nn.Module, *, precision_ok: bool = True) -> dict[str, Any]:
    """A random plan's fields (construction or apply may refuse them: that is part of the test)."""
    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    fields: dict[str, Any] = {}
    freezing = rng.random()
    if freezing < 0.55:  # a preset, as the tuner offers them
        presets = presets_for(model)
        label = rng.choice(sorted(presets))
        fields.update(frozen=list(presets[label].frozen), trainable=list(presets[label].trainable))
    elif freezing < 0.8:
        names = modules + params + ["*", "*.bias", "*.weight", "*lora*"]
        fields.update(
            frozen=rng.sample(names, rng.choice([0, 1, 2])), trainable=rng.sample(names, rng.choice([0, 0, 1, 2]))
        )
    memsave = rng.random()
    if memsave < 0.45:
        fields["memsave"] = ["*"]
    elif memsave < 0.65:
        fields["memsave"] = rng.sample(modules, rng.randint(1, 3))
    candidates = _region_candidates(model)
    fields["regions"] = {n: random_policy(rng) for n in rng.sample(candidates, rng.choice([0, 1, 1, 2, 2, 3]))}
    if rng.random() < 0.25:
        fields["input_requires_grad"] = rng.choice([True, True, False])
    # knobs
    if rng.random() < 0.35:
        fields["batch_size"] = rng.choice([1, 3])
    if rng.random() < 0.35:
        fields["seq_len"] = rng.choice([4, 6, 12, 12, 20])  # 20: beyond GPT-2's and Llama's 16 positions
    if rng.random() < 0.35:
        fields["accumulation_steps"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        fields["optimizer"] = rng.choice(OPTIMIZERS)
    if rng.random() < 0.2:
        fields["set_to_none"] = rng.choice([True, False])
    if precision_ok and rng.random() < 0.7:
        fields["precision"] = rng.choice(PRECISIONS)
    return fields


# -- the oracle: plain PyTorch, no plan ----------------------------------------------------------
def _resize(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` cut to ``n`` along ``dim``, or tiled along it and cut (the knobs' documented rule)."""
    while t.shape[dim] < n:
        t = torch.cat([t, t], dim=dim)
    return t.narrow(dim, 0, n).contiguous()


def resized_batch(
    batch: dict[str, torch.Tensor], batch_size: int | None, seq_len: int | None
) -> dict[str, torch.Tensor]:
    out = dict(batch)
    if seq_len is not None:
        out = {k: _resize(v, 1, seq_len) for k, v in out.items()}
    if batch_size is not None:
        out = {k: _resize(v, 0, batch_size) for k, v in out.items()}
    return out


def plain_gradients(
    model: nn.Module, batch: dict[str, torch.Tensor], *, accumulation: int, autocast: torch.dtype | None, seed: int
) -> dict[int, torch.Tensor]:
    """``{id(parameter): grad}`` of a plain training step: every parameter trainable, ``accumulation``
    micro-batches of ``loss / k`` (the same batch each, dropout drawing on), optional autocast."""
    flags = {p: p.requires_grad for p in model.parameters()}
    grads_before = {p: p.grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(True)
            p.grad = None
        torch.manual_seed(seed)
        for _ in range(accumulation):
            if autocast is not None:
                with torch.autocast("cpu", dtype=autocast):
                    loss = model(**batch).loss
            else:
                loss = model(**batch).loss
            (loss / accumulation if accumulation > 1 else loss).backward()
        return {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
            p.grad = grads_before[p]


# -- checking -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    tried: int = 0
    compared: int = 0  # gradients compared against the oracle, real = fake checked
    refused: int = 0  # one-line PlanError, model unchanged
    skipped: int = 0  # nothing to differentiate
    compared_tensors: int = 0
    snippets: int = 0  # compared plans whose to_code() snippet was also run on a fresh model
    kinds: dict[str, int] = field(default_factory=dict)  # what the compared plans combined
    refusals: set[str] = field(default_factory=set)

    def note(self, fields: dict[str, Any]) -> None:
        kinds = {str(p.get("kind") if isinstance(p, dict) else p) for p in fields.get("regions", {}).values()}
        tags = [f"region:{k}" for k in kinds] + [
            k
            for k in ("memsave", "batch_size", "seq_len", "accumulation_steps", "precision", "optimizer", "set_to_none")
            if fields.get(k)
        ]
        if fields.get("memsave") and fields.get("regions"):
            tags.append("memsave+regions")
        if fields.get("precision") and fields.get("regions"):
            tags.append("precision+regions")
        if fields.get("accumulation_steps") and fields.get("regions"):
            tags.append("accumulation+regions")
        for tag in tags:
            self.kinds[tag] = self.kinds.get(tag, 0) + 1


def _use_cache(model: nn.Module) -> list[Any]:
    return [
        m.__dict__["config"].__dict__.get("use_cache", "<class default>")
        for m in model.modules()
        if "config" in m.__dict__ and hasattr(m.__dict__["config"], "use_cache")
    ]


class Checker:
    """One model in float64 (and float32 for the precision knobs); oracles cached per knob setting."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.workloads = {(torch.float64, False): build(name, torch.float64)}
        self._oracles: dict[tuple, dict[int, torch.Tensor]] = {}

    def workload(self, dtype: torch.dtype, embeds: bool = False) -> Workload:
        """The model in ``dtype`` (each dtype its own model object, the same weights), fed token
        ids or, with ``embeds``, ``inputs_embeds`` (same model object as the ids batch)."""
        if (dtype, embeds) not in self.workloads:
            base = self.workloads.get((dtype, False)) or build(self.name, dtype)
            self.workloads[(dtype, False)] = base
            if embeds:
                self.workloads[(dtype, True)] = base.replace(
                    batch=build(self.name, dtype, embeds=True).batch, name=base.name + "-embeds"
                )
        return self.workloads[(dtype, embeds)]

    def oracle(self, wl: Workload, plan: Plan) -> dict[int, torch.Tensor]:
        key = (wl.name, plan.batch_size, plan.seq_len, plan.accumulation_steps or 1, plan.precision)
        if key not in self._oracles:
            model = wl.model
            batch = resized_batch(wl.batch, plan.batch_size, plan.seq_len)
            if plan.precision in ("bf16", "bf16_master"):  # a bf16 copy: the same weights, rounded
                twin = copy.deepcopy(model).to(torch.bfloat16)
                batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in batch.items()}
                grads = plain_gradients(
                    twin, batch, accumulation=plan.accumulation_steps or 1, autocast=None, seed=SEED
                )
                by_index = [grads.get(id(p)) for p in twin.parameters()]
                grads = {id(p): g for p, g in zip(model.parameters(), by_index) if g is not None}
            else:
                grads = plain_gradients(
                    model,
                    batch,
                    accumulation=plan.accumulation_steps or 1,
                    autocast=AUTOCAST.get(plan.precision or ""),
                    seed=SEED,
                )
            self._oracles[key] = grads
        return self._oracles[key]

    def check(
        self,
        fields: dict[str, Any],
        outcome: Outcome,
        steady_state: bool = False,
        embeds: bool = False,
        snippet: bool = False,
    ) -> None:
        """Build, apply and measure the plan (real, then fake); assert stock gradients, real = fake
        bytes, the model unchanged, or a one-line PlanError that changed nothing. ``steady_state``:
        measure training's second step (the gradients compared are the first step's). ``embeds``: the
        batch is ``inputs_embeds`` (float: the input may require grad). ``snippet``: also run the plan's
        ``to_code()`` on a fresh model (:meth:`check_snippet`)."""
        outcome.tried += 1
        dtype = torch.float32 if fields.get("precision") else torch.float64
        wl = self.workload(dtype, embeds and self.name in EMBEDS_MODELS)
        model = wl.model
        before = ModelSnapshot.capture(model)
        cache_before = _use_cache(model)
        batch_before = {k: v.clone() for k, v in wl.batch.items()}

        def unchanged() -> None:
            assert before.differences(model) == [], before.differences(model)
            assert _use_cache(model) == cache_before, (cache_before, _use_cache(model))
            assert all(torch.equal(wl.batch[k], v) for k, v in batch_before.items()), "the batch changed"
            assert all(p.dtype == dtype for p in model.parameters()), "parameter dtypes changed"

        grads: dict[int, torch.Tensor] = {}
        names = {id(p): n for n, p in model.named_parameters()}

        def capture(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            with _disable_current_modes():  # our copies are not the step's memory: hide them from the tracker
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if id(p) in names and p.grad is not None and id(p) not in grads:
                            grads[id(p)] = p.grad.detach().clone()

        try:
            plan = Plan(**fields)
            trainable = set(plan.trainable_parameter_names(model))
            input_grad = bool(plan.input_requires_grad) and "inputs_embeds" in wl.batch
            if not trainable and not input_grad:  # token ids cannot require grad: nothing to differentiate
                outcome.skipped += 1
                return
            handle = register_optimizer_step_pre_hook(capture)
            try:
                torch.manual_seed(SEED)
                with plan.apply(wl) as applied:
                    real = measure(applied, "real", repeats=0, flops=False, steady_state=steady_state)
            finally:
                handle.remove()
            unchanged()
            with plan.apply(wl) as applied:
                fake = measure(applied, "fake", flops=False, steady_state=steady_state)
        except PlanError as exc:
            text = str(exc)
            assert text and "\n" not in text, f"a refusal must be one line: {text!r}"
            unchanged()
            outcome.refused += 1
            outcome.refusals.add(text.split(":")[0][:60])
            return
        unchanged()
        # gradients: those the plan trains, equal to plain PyTorch's
        expected = self.oracle(wl, plan)
        got_names = sorted(names[i] for i in grads)
        want_names = sorted(names[i] for i in expected if names[i] in trainable)
        assert got_names == want_names, sorted(set(got_names) ^ set(want_names))
        rtol, atol = _tolerance(plan.precision, dtype)
        for i, g in grads.items():
            torch.testing.assert_close(g, expected[i], rtol=rtol, atol=atol, msg=lambda m, n=names[i]: f"{n}: {m}")
            outcome.compared_tensors += 1
        # fake mode counts what real mode counts (docs/architecture.md: "bytes equal real mode on the CPU")
        assert_fake_equals_real(fake, real)
        outcome.compared += 1
        outcome.note(fields)
        if snippet:
            self.check_snippet(plan, wl, real, dtype, embeds and self.name in EMBEDS_MODELS)
            outcome.snippets += 1

    def check_snippet(self, plan: Plan, wl: Workload, real: Any, dtype: torch.dtype, embeds: bool) -> None:
        """``plan.to_code()`` run on a fresh copy of the model (same seed, same weights) trains the same
        parameters with the same gradients (a plain loop doing what the snippet's comments say for the
        knobs: resized batch, accumulation, autocast) and, measured under the plan's knobs only, keeps
        the plan's bytes (but offload: on the CPU the snippet's host copy is device memory too)."""
        fresh = build(self.name, dtype, embeds)
        namespace: dict[str, Any] = {"net": fresh.model}
        exec(compile(plan.to_code(model_var="net"), "<plan>", "exec", dont_inherit=True), namespace)  # noqa: S102
        net = namespace["net"]
        trained = {n for n, p in net.named_parameters() if p.requires_grad}
        assert trained == set(plan.trainable_parameter_names(wl.model)), sorted(
            trained ^ set(plan.trainable_parameter_names(wl.model))
        )
        batch = resized_batch(fresh.batch, plan.batch_size, plan.seq_len)
        if plan.precision in ("bf16", "bf16_master"):
            batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in batch.items()}
        grads_before = {p: p.grad for p in net.parameters()}
        torch.manual_seed(SEED)
        for _ in range(plan.accumulation_steps or 1):
            with (
                torch.autocast("cpu", dtype=AUTOCAST[plan.precision])
                if plan.precision in AUTOCAST
                else contextlib.nullcontext()
            ):
                loss = net(**batch).loss
            (loss / (plan.accumulation_steps or 1)).backward()
        expected = self.oracle(wl, plan)
        by_name = {n: expected[id(p)] for n, p in wl.model.named_parameters() if id(p) in expected}
        rtol, atol = _tolerance(plan.precision, dtype)
        for n, p in net.named_parameters():
            if p.requires_grad and n not in by_name:  # unused by this batch (embeddings of an inputs_embeds step)
                assert p.grad is None, f"snippet {n}: a gradient plain PyTorch does not compute"
            elif p.requires_grad:
                torch.testing.assert_close(
                    p.grad, by_name[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"snippet {n}: {m}"
                )
        for p in net.parameters():
            p.grad = grads_before[p]
        if any(r.kind.value == "offload" for r in plan.active_regions.values()):
            return
        knobs = Plan(**{k: getattr(plan, k) for k in KNOB_FIELDS}, input_requires_grad=plan.input_requires_grad)
        with knobs.apply(fresh.replace(model=net)) as applied:
            got = measure(applied, "real", repeats=0, flops=False, steady_state=real.steady_state)
        assert (got.saved_bytes, got.output_bytes, got.peak_bytes) == (
            real.saved_bytes,
            real.output_bytes,
            real.peak_bytes,
        ), (
            f"snippet: saved/outputs/peak {(got.saved_bytes, got.output_bytes, got.peak_bytes)} != plan's {(real.saved_bytes, real.output_bytes, real.peak_bytes)}"
        )


def assert_fake_equals_real(fake: Any, real: Any) -> None:
    pairs = [
        (k, getattr(fake, k), getattr(real, k))
        for k in (
            "peak_bytes",
            "saved_bytes",
            "output_bytes",
            "peak_split",
            "end_of_forward",
            "output_parts",
            "first_step_peak_bytes",
        )
    ]
    wrong = [f"{k}: fake {f} != real {r}" for k, f, r in pairs if f != r]
    rows = {(m.name, m.saved_bytes, m.output_bytes) for m in fake.modules} ^ {
        (m.name, m.saved_bytes, m.output_bytes) for m in real.modules
    }
    if rows:
        wrong.append(f"module rows differ: {sorted(rows)[:6]}")
    assert not wrong, "; ".join(wrong)


def _tolerance(precision: str | None, dtype: torch.dtype) -> tuple[float, float]:
    """float64: the same ops in the same order, so equal up to rounding of a reordered sum; float32
    under autocast: bf16 matmuls on both sides, recomputation replays them exactly; bf16 parameters:
    the oracle is a bf16 copy, so the same ops again."""
    if dtype == torch.float64:
        return 1e-9, 1e-12
    if precision in ("bf16", "bf16_master"):
        return 1e-2, 1e-4
    return 1e-5, 1e-7


def replay(
    model: str, fields_json: str, steady_state: bool = False, embeds: bool = False, snippet: bool = False
) -> Outcome:
    """Re-run one plan printed by a failure: ``replay("gpt2", '{"regions": ...}', False, False, False)``."""
    outcome = Outcome()
    Checker(model).check(json.loads(fields_json), outcome, steady_state, embeds, snippet)
    return outcome
