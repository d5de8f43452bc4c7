"""The layers' C kernels where users meet them: a Hugging Face T5 (ReLU feed-forward) and a
Hugging Face ResNet (ReLU, max pool), built from configs, converted and combined with freezing,
full and selective regions, trained for several steps without any tracker (the kernels run only
there). Gradients equal plain PyTorch's, and the kernels did run (counted): the mask kernels,
the one-pass ReLU + mask from the second step on, and the pool's index conversions."""

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
    for module, name, key in ((activation, "select_bits", "select"),
                              (activation, "relu_pack", "relu_pack"),
                              (pool, "pool_offsets", "pool_offsets"),
                              (pool, "pool_flat", "pool_flat")):
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
        torch.testing.assert_close(g, expected[id(params[name])], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _resnet() -> Workload:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="basic", hidden_act="relu", num_labels=4)
    model = ResNetForImageClassification(config).train()
    gen = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen),
             "labels": torch.tensor([0, 3])}
    return Workload(model, batch, name="hf-resnet")


@pytest.mark.slow
def test_hf_resnet_plan_runs_the_pool_and_relu_kernels_with_plain_gradients(calls) -> None:
    """A Hugging Face ResNet (stem conv, BN, ReLU, 3x3 max pool) under a plan that converts the
    layers, freezes the first stage (its frozen convs keep nothing, so the ReLUs keep masks) and
    recomputes the second stage: three steps, plain PyTorch's gradients, every kernel counted."""
    plan = Plan(memsave=("*",), frozen=("resnet.encoder.stages.0.*",),
                regions={"resnet.encoder.stages.1": "full"})
    wl = _resnet()
    expected = plain_gradients(wl.model, wl.batch, accumulation=1, autocast=None, seed=0)
    trainable = set(plan.trainable_parameter_names(wl.model))
    assert trainable and not any(n.startswith("resnet.encoder.stages.0.") for n in trainable)
    params = dict(wl.model.named_parameters())
    got = _steps_under(plan, wl, 3, trainable)
    assert calls["pool_offsets"] >= 3 and calls["pool_flat"] >= 3, calls
    assert calls["relu_pack"] >= 2 and calls["select"] >= 3, calls
    for name, g in got.items():
        torch.testing.assert_close(g, expected[id(params[name])], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert all(p.grad is None for n, p in params.items() if n not in trainable)
