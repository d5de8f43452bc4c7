"""The layers' C kernels where users meet them: a Hugging Face T5 (ReLU feed-forward) and a
Hugging Face ResNet (ReLU, max pool), built from configs, converted and combined with freezing,
full and selective regions, trained for several steps without any tracker (the kernels run only
there). Gradients equal plain PyTorch's, and the kernels did run (counted): the mask kernels,
the one-pass ReLU + mask from the second step on, and the pool's index conversions; and, with
dropout drawing, GPT-2 and a peft LoRA Llama whose dropouts pack and scale in C."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.layers import _native, activation, pool
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

from .hf_plans import plain_gradients
from .real_cases import t5

pytestmark = pytest.mark.skipif(not _native.available(), reason=f"fused kernels: {_native.status()}")

# the feed-forward's output projection frozen: nothing keeps the ReLU's output, so its mask backs it
PLAN = Plan(
    memsave=("*",),
    frozen=("*.DenseReluDense.wo.*", "shared.*"),
    regions={"encoder.block.1": "full", "decoder.block.0": "save_matmuls"},
)


def _model() -> Workload:
    torch.manual_seed(0)
    model, batch = t5()
    for m in model.modules():  # no dropout: the oracle and the plan draw nothing
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return Workload(model.train(), batch, name="t5")


@pytest.fixture()
def calls(monkeypatch):
    """Runs of each C kernel entry (a None result: it stood aside), by short name."""
    seen = {"select": 0, "relu_pack": 0, "pool_offsets": 0, "pool_flat": 0}
    for module, name, key in (
        (activation, "select_bits", "select"),
        (activation, "relu_pack", "relu_pack"),
        (pool, "pool_offsets", "pool_offsets"),
        (pool, "pool_flat", "pool_flat"),
    ):
        real = getattr(module, name)

        def counting(*args, _real=real, _key=key):
            out = _real(*args)
            seen[_key] += out is not None
            return out

        monkeypatch.setattr(module, name, counting)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t5_plan_with_fused_kernels_gives_plain_gradients(calls, dtype) -> None:
    wl = _model()
    wl.model.to(dtype)
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(PLAN.trainable_parameter_names(wl.model))
    assert trainable and not any(".wo." in n for n in trainable)
    params = dict(wl.model.named_parameters())
    with PLAN.apply(wl) as applied:
        torch.manual_seed(0)
        applied.model(**applied.batch).loss.backward()
        got = {n: params[n].grad.detach().clone() for n in trainable}
    # one per feed-forward: 2 encoder (one inside the full region), 2 decoder (one selective)
    assert calls["select"] >= 4, calls
    # the order gradients are summed in changes with what is frozen: float rounding only
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for name, g in got.items():
        torch.testing.assert_close(g, expected[id(params[name])], **tol, msg=lambda m, n=name: f"{n}: {m}")
    assert all(p.grad is None for n, p in params.items() if n not in trainable)


@pytest.mark.slow
def test_t5_plan_snippet_runs_the_fused_kernels(calls) -> None:
    """The plan copied out as code, run on a fresh model in a plain loop: same gradients, and the
    converted layers' fused kernels ran there too."""
    wl = _model()
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(PLAN.trainable_parameter_names(wl.model))
    fresh = _model()
    namespace = {"net": fresh.model}
    exec(compile(PLAN.to_code(model_var="net"), "<plan>", "exec", dont_inherit=True), namespace)  # noqa: S102
    net = namespace["net"]
    torch.manual_seed(0)
    net(**fresh.batch).loss.backward()
    assert calls["select"] >= 4, calls
    ref = dict(wl.model.named_parameters())
    got = {n: p.grad for n, p in net.named_parameters() if p.requires_grad}
    assert set(got) == trainable
    for name, g in got.items():
        torch.testing.assert_close(g, expected[id(ref[name])], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _steps_under(plan: Plan, wl: Workload, steps: int, names: set[str]) -> dict[str, torch.Tensor]:
    """``steps`` training steps (no optimizer: the same parameters) under ``plan``; the last
    step's gradients of ``names``."""
    params = dict(wl.model.named_parameters())
    with plan.apply(wl) as applied:
        for _ in range(steps):
            for n in names:
                params[n].grad = None
            torch.manual_seed(0)
            applied.model(**applied.batch).loss.backward()
        return {n: params[n].grad.detach().clone() for n in names}


@pytest.mark.slow
def test_t5_plan_over_steps_packs_relu_and_mask_in_one_pass(calls) -> None:
    """From the second step a ReLU whose output nobody keeps packs its mask in its own forward,
    in one pass with the ReLU (relu_pack); gradients stay plain PyTorch's at every step count."""
    wl = _model()
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(PLAN.trainable_parameter_names(wl.model))
    params = dict(wl.model.named_parameters())
    got = _steps_under(PLAN, wl, 3, trainable)
    assert calls["relu_pack"] >= 2, calls  # steps 2 and 3, at least one feed-forward each
    assert calls["select"] >= 12, calls
    for name, g in got.items():
        torch.testing.assert_close(
            g, expected[id(params[name])], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _resnet() -> Workload:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
        num_labels=4,
    )
    model = ResNetForImageClassification(config).train()
    gen = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen), "labels": torch.tensor([0, 3])}
    return Workload(model, batch, name="hf-resnet")


@pytest.mark.slow
def test_hf_resnet_plan_runs_the_pool_and_relu_kernels_with_plain_gradients(calls) -> None:
    """A Hugging Face ResNet (stem conv, BN, ReLU, 3x3 max pool) under a plan that converts the
    layers, freezes the first stage (its frozen convs keep nothing, so the ReLUs keep masks) and
    recomputes the second stage: three steps, plain PyTorch's gradients, every kernel counted."""
    plan = Plan(memsave=("*",), frozen=("resnet.encoder.stages.0.*",), regions={"resnet.encoder.stages.1": "full"})
    wl = _resnet()
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(plan.trainable_parameter_names(wl.model))
    assert trainable and not any(n.startswith("resnet.encoder.stages.0.") for n in trainable)
    params = dict(wl.model.named_parameters())
    got = _steps_under(plan, wl, 3, trainable)
    assert calls["pool_offsets"] >= 3 and calls["pool_flat"] >= 3, calls
    assert calls["relu_pack"] >= 2 and calls["select"] >= 3, calls
    for name, g in got.items():
        torch.testing.assert_close(
            g, expected[id(params[name])], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert all(p.grad is None for n, p in params.items() if n not in trainable)


def _lora_llama_with_dropout() -> Workload:
    from transformers import LlamaForCausalLM

    from .real_cases import _ids, _llama_config, _transformers

    peft = pytest.importorskip("peft", reason="peft is not installed (test extra)")
    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config(_transformers()))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # lora_B starts at zero: give it values, so lora_A gets a gradient
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    ids = _ids()
    return Workload(model.train(), {"input_ids": ids, "labels": ids}, name="lora-llama-dropout")


def _gpt2_with_dropout() -> Workload:
    from .real_cases import gpt2

    torch.manual_seed(0)
    model, batch = gpt2()  # dropout 0.1 on embeddings, attention output and MLP (nn.Dropout)
    return Workload(model.train(), batch, name="gpt2-dropout")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gpt2", "lora_llama"])
def test_hf_plan_with_dropout_drawing_runs_the_dropout_kernels_with_plain_gradients(monkeypatch, case: str) -> None:
    """Dropout on, as fine-tuning runs it: GPT-2 (its own dropouts) and a peft LoRA Llama
    (``lora_dropout``), under a plan that converts the layers and combines freezing, a full
    region and a selective (SAC) region; two untracked steps under one seed draw the same masks
    as plain PyTorch (recomputation replays the generator), so the gradients are plain
    PyTorch's, and the dropout's one-pass pack and scaling kernels ran (counted)."""
    from memsave_nb.layers import dropout

    seen = {"scale_bits": 0, "pack_nonzero": 0}
    for name in seen:
        real = getattr(dropout, name)

        def counting(*args, _real=real, _name=name):
            out = _real(*args)
            seen[_name] += out is not None
            return out

        monkeypatch.setattr(dropout, name, counting)
    if case == "gpt2":
        wl = _gpt2_with_dropout()
        plan = Plan(
            memsave=("*",),
            frozen=("transformer.wte.*", "transformer.h.0.mlp.*"),
            regions={"transformer.h.0": "full", "transformer.h.1": "save_matmuls"},
        )
    else:
        wl = _lora_llama_with_dropout()
        # the adapters train; layer 0's input needs no gradient (frozen embeddings), so its
        # dropouts run stock's op: the selective region goes there, layer 1's run the kernels
        plan = Plan(
            memsave=("*",),
            frozen=("*",),
            trainable=("*lora_*",),
            regions={"base_model.model.model.layers.0": "save_matmuls"},
        )
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(plan.trainable_parameter_names(wl.model))
    assert trainable
    params = dict(wl.model.named_parameters())
    got = _steps_under(plan, wl, 2, trainable)
    # the dropouts outside the regions pack from their noise in forward (inside a region the
    # forward runs under the region's hooks or mode, where only torch ops may run), and the
    # scaling kernel backs them in backward, both steps
    assert seen["scale_bits"] >= 4 and seen["pack_nonzero"] >= 4, seen
    for name, g in got.items():
        torch.testing.assert_close(
            g, expected[id(params[name])], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert all(p.grad is None for n, p in params.items() if n not in trainable)
