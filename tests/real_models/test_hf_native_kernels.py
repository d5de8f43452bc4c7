"""The layers' fused mask kernels where users meet them: a Hugging Face T5 (ReLU feed-forward)
built from a config, converted and combined with freezing, a full region and a selective region,
trained without any tracker (the kernels run only there). Gradients equal plain PyTorch's, and the
kernels did run (counted), both when a plan converts the layers and through the plan's snippet."""

from __future__ import annotations

import pytest
import torch

from memsave_nb.layers import _native, activation
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
    seen = {"select": 0}
    real = activation.select_bits

    def counting(grad, packed):
        out = real(grad, packed)
        seen["select"] += out is not None
        return out

    monkeypatch.setattr(activation, "select_bits", counting)
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
