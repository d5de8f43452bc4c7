"""Second-order gradients (gradgradcheck, float64) of every memory-saving layer; max pooling
inside a selective-checkpointing region and on an empty batch (issue 9, sections 2 and 6)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memsave_nb.layers import MEMSAVE_LAYERS, compact, pool


def _memsave(stock: nn.Module) -> nn.Module:
    stock.__class__ = MEMSAVE_LAYERS[type(stock)]
    return stock.double()


def _distinct(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Float64 values far from each other and from zero: no ties for max pooling, no kinks
    within the finite-difference step for ReLU."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    values = (torch.randperm(n, generator=gen).double() - n / 2 + 0.5) / 7
    return values.view(shape)


# (name, stock module, input shape, which parameters train)
CASES = [
    ("conv2d_frozen", lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5), ()),
    ("conv2d_frozen_bias", lambda: nn.Conv2d(2, 3, 3, stride=2), (2, 2, 6, 6), ("bias",)),
    ("conv1d_frozen_odd", lambda: nn.Conv1d(2, 2, 3, stride=2, padding=1), (1, 2, 8), ()),
    ("conv2d_1x1_frozen", lambda: nn.Conv2d(3, 2, 1, stride=2), (1, 3, 5, 5), ()),
    ("conv_transpose2d_frozen", lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, output_padding=1), (1, 2, 3, 3), ()),
    ("conv2d_trainable", lambda: nn.Conv2d(2, 2, 3), (1, 2, 4, 4), ("weight", "bias")),
    ("batchnorm_eval_frozen", lambda: nn.BatchNorm2d(3).eval(), (2, 3, 2, 2), ("bias",)),
    ("batchnorm_train", lambda: nn.BatchNorm2d(3), (2, 3, 2, 2), ("weight", "bias")),
    ("relu", lambda: nn.ReLU(), (2, 3, 4), ()),
    ("leaky_relu", lambda: nn.LeakyReLU(0.2), (2, 3, 4), ()),
    ("leaky_relu_negative", lambda: nn.LeakyReLU(-0.3), (2, 3, 4), ()),
    ("rmsnorm", lambda: nn.RMSNorm(4), (3, 4), ("weight",)),
    ("rmsnorm_2d_shape", lambda: nn.RMSNorm((2, 3), eps=1e-3), (2, 2, 3), ("weight",)),
    ("maxpool1d", lambda: nn.MaxPool1d(3, 2, 1), (2, 2, 7), ()),
    ("maxpool2d", lambda: nn.MaxPool2d(3, 2, 1), (2, 2, 5, 5), ()),
    ("maxpool2d_dilated_ceil", lambda: nn.MaxPool2d(2, 2, dilation=2, ceil_mode=True), (1, 2, 6, 6), ()),
    ("maxpool3d", lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4), ()),
    ("relu6", lambda: nn.ReLU6(), (2, 3, 4), ()),
    ("hardtanh", lambda: nn.Hardtanh(-0.45, 0.66), (2, 3, 4), ()),
    ("adaptive_maxpool1d", lambda: nn.AdaptiveMaxPool1d(3), (2, 2, 7), ()),
    ("adaptive_maxpool2d", lambda: nn.AdaptiveMaxPool2d((2, 3)), (1, 2, 5, 7), ()),
    ("adaptive_maxpool3d", lambda: nn.AdaptiveMaxPool3d(2), (1, 1, 3, 4, 5), ()),
]


@pytest.mark.parametrize("name,make,shape,train", CASES, ids=[c[0] for c in CASES])
def test_gradgradcheck(name: str, make, shape: tuple[int, ...], train: tuple[str, ...]) -> None:
    torch.manual_seed(0)
    layer = _memsave(make())
    for pname, p in layer.named_parameters():
        p.requires_grad_(pname in train)
    if name.startswith("rmsnorm"):
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
    x = _distinct(shape).requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]

    def fn(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return layer(x * 1)

    assert gradcheck(fn, (x, *params))
    assert gradgradcheck(fn, (x, *params))


def test_rmsnorm_second_order_equals_stock() -> None:
    """The repro of issue 9: d(|grad x|^2)/dx of RMSNorm against stock's."""
    stock = nn.RMSNorm(3).double()
    ours = _memsave(nn.RMSNorm(3))
    results = []
    for layer in (stock, ours):
        x = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(layer(x).pow(3).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.pow(2).sum(), x)
        results.append(ggx)
    torch.testing.assert_close(results[1], results[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("stock_cls", [nn.Dropout, nn.Dropout2d, nn.AlphaDropout, nn.FeatureAlphaDropout])
def test_dropout_second_order_equals_stock(stock_cls) -> None:
    x0 = _distinct((4, 6, 2, 2))
    results = []
    for cls in (stock_cls, MEMSAVE_LAYERS[stock_cls]):
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(3)
        y = cls(0.4)(x * 1)
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.pow(2).sum(), x)
        results.append((y.detach(), ggx))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def _save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("policy", [_save_all, _recompute_all], ids=["save", "recompute"])
@pytest.mark.parametrize("window", [3, 20])  # table lookup / division fallback (window > input)
@pytest.mark.parametrize("chunk", [None, 7])  # 7: the batch pooled in several chunks
def test_maxpool_in_selective_checkpoint_region(policy, window: int, chunk, monkeypatch) -> None:
    """SAC caches op outputs and refuses them once mutated: the pool's flat indices must not
    be changed in place there."""
    if chunk is not None:
        monkeypatch.setattr(pool, "_CHUNK_NUMEL", chunk)
    stock = nn.Sequential(nn.Conv2d(2, 2, 1), nn.MaxPool2d(window, 2, window // 2))
    ours = _memsave_model(stock)
    x = torch.randn(2, 2, 9, 9)
    grads = []
    for model in (stock, ours):
        xi = x.clone().requires_grad_(True)
        ctx = functools.partial(create_selective_checkpoint_contexts, policy)
        out = checkpoint(model, xi, use_reentrant=False, context_fn=ctx)
        out.square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
        model.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _memsave_model(stock: nn.Module) -> nn.Module:
    import copy

    from memsave_nb.layers import convert

    ours = copy.deepcopy(stock)
    convert(ours)
    return ours


@pytest.mark.parametrize("n", [1, 2, 3])
def test_maxpool_on_empty_batch_runs_like_stock(n: int) -> None:
    stock = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}[n](2)
    ours = MEMSAVE_LAYERS[type(stock)](2)
    x = torch.randn(0, 3, *([4] * n), requires_grad=True)
    ya, yb = stock(x), ours(x)
    assert ya.shape == yb.shape
    (ga,) = torch.autograd.grad(ya.sum(), x)
    (gb,) = torch.autograd.grad(yb.sum(), x)
    assert ga.shape == gb.shape == x.shape


@pytest.mark.parametrize("stock_cls", [nn.ReLU, nn.ReLU6, nn.Hardtanh])
def test_masked_activation_second_order_equals_stock(stock_cls) -> None:
    """create_graph through an activation whose output nobody keeps (so backward runs from its
    packed mask, where the fused kernel would run): the input gradient must stay differentiable
    with respect to the incoming gradient, as stock's ``threshold_backward`` is."""
    x0 = _distinct((2, 3, 8, 8)) * 3
    results = []
    for memsave in (False, True):
        layer = stock_cls()
        if memsave:
            layer = _memsave(layer)
        model = nn.Sequential(layer).double()
        x = x0.clone().requires_grad_(True)
        y = model(x * 1) * 2.0  # the activation's output is dropped: a mask is what backs it
        compact()
        (gx,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)  # a contiguous grad
        (ggx,) = torch.autograd.grad(gx.pow(2).sum(), x)
        results.append((gx.detach(), ggx))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
