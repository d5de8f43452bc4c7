"""convert / revert: in place, same objects, exact round trip; converted models train alike."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from layer_models import small_cnn
from memsave_nb.layers import MEMSAVE_LAYERS, Conversion, convert, revert


def snapshot(model: nn.Module) -> dict:
    return {
        "modules": [(n, m, type(m)) for n, m in model.named_modules()],
        "params": [(n, p) for n, p in model.named_parameters()],
        "buffers": [(n, b) for n, b in model.named_buffers()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_convert_swaps_in_place_and_revert_restores_exactly() -> None:
    model = small_cnn()
    before = snapshot(model)
    calls: list[str] = []
    model[0].register_forward_hook(lambda *a: calls.append("hook"))
    model.eval()
    conversion = convert(model)
    assert isinstance(conversion, Conversion)
    assert conversion.names == ["0", "1", "2", "3", "4.conv1", "4.bn1", "4.relu", "4.conv2", "4.bn2", "5", "6"]
    for (name, module, cls), (name2, module2) in zip(before["modules"], model.named_modules()):
        assert name == name2 and module is module2  # the same objects
        assert isinstance(module2, cls)  # subclasses: user isinstance checks keep working
        assert type(module2) is MEMSAVE_LAYERS.get(cls, cls)
        assert module2.training is False
    assert [p for _, p in model.named_parameters()] == [p for _, p in before["params"]]
    model(torch.randn(1, 3, 8, 8))
    assert calls == ["hook"]
    revert(conversion)
    after = snapshot(model)
    assert [(n, id(m), c) for n, m, c in after["modules"]] == [(n, id(m), c) for n, m, c in before["modules"]]
    assert all(a[1] is b[1] for a, b in zip(after["params"], before["params"]))
    assert all(a[1] is b[1] for a, b in zip(after["buffers"], before["buffers"]))
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in after["state"])
    assert not model._forward_hooks  # convert's own hook removed
    revert(conversion)  # idempotent


def test_include_exclude_patterns() -> None:
    model = small_cnn()
    with convert(model, include=["4.*"], exclude="4.bn?") as conversion:
        assert conversion.names == ["4.conv1", "4.relu", "4.conv2"]
        assert type(model[0]) is nn.Conv2d
    assert type(model[4].conv1) is nn.Conv2d


def test_user_subclasses_are_left_alone() -> None:
    class MyConv(nn.Conv2d):
        pass

    model = nn.Sequential(MyConv(3, 3, 1), nn.Conv2d(3, 3, 1))
    assert convert(model).names == ["1"]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("trainable", ["all", "none", "norm", "conv", "head"])
def test_converted_model_trains_like_stock(train: bool, trainable: str) -> None:
    torch.manual_seed(0)
    stock = small_cnn().train(train)
    ours = copy.deepcopy(stock)
    convert(ours)
    for model in (stock, ours):
        for name, p in model.named_parameters():
            m = model.get_submodule(name.rsplit(".", 1)[0])
            p.requires_grad_(
                {
                    "all": True,
                    "none": False,
                    "norm": isinstance(m, nn.BatchNorm2d),
                    "conv": isinstance(m, nn.Conv2d),
                    "head": isinstance(m, nn.Linear),
                }[trainable]
            )
    x = torch.randn(2, 3, 8, 8)
    results = []
    for model in (stock, ours):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(1)  # the same dropout draw
        out = model(xi)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (ya, ga, pa), (yb, gb, pb) = results
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    torch.testing.assert_close(gb, ga)
    for name in pa:
        assert (pa[name] is None) == (pb[name] is None), name
        if pa[name] is not None:
            torch.testing.assert_close(pb[name], pa[name], msg=name)
    assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(), ours.state_dict().values()))


def test_freezing_between_steps_just_works() -> None:
    model = small_cnn()
    convert(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(x).sum().backward()
    model.requires_grad_(False)
    model(x).sum().backward()
    model.requires_grad_(True)
    x.requires_grad_(False)
    model(x).sum().backward()


def test_root_hook_shrinks_what_is_left_after_forward() -> None:
    """After a converted model's forward, no ReLU output is held that only its holder keeps."""
    from layer_counting import LiveStorages

    from memsave_nb.layers import _holder

    model = small_cnn().eval().requires_grad_(False)
    convert(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with LiveStorages():
        out = model(x * 1)
    live = [ref() for ref in _holder._pending if ref() is not None]
    assert all(h.output is None for h in live)
    out.sum().backward()


_INPLACE_LAYERS = [
    lambda: nn.ReLU(inplace=True),
    lambda: nn.LeakyReLU(0.1, inplace=True),
    lambda: nn.ReLU6(inplace=True),
    lambda: nn.Hardtanh(-0.5, 0.5, inplace=True),
    lambda: nn.Dropout(0.5, inplace=True),
    lambda: nn.Dropout2d(0.5, inplace=True),
    lambda: nn.AlphaDropout(0.5, inplace=True),
    lambda: nn.FeatureAlphaDropout(0.5, inplace=True),
]


@pytest.mark.parametrize("make", _INPLACE_LAYERS)
@pytest.mark.parametrize("view", [False, True])
def test_inplace_on_a_leaf_behaves_as_stock_and_loses_nothing(make, view: bool) -> None:
    """Stock refuses some in-place ops on a leaf that requires grad (or a view of one) before
    touching it; a converted layer must raise the same error with the data as it was, not
    change the data and fail afterwards. Where stock runs, it runs the same (same seed)."""

    def run(layer: nn.Module) -> tuple[str | None, torch.Tensor | None, torch.Tensor]:
        leaf = torch.linspace(-2.0, 2.0, 2 * 4 * 3 * 3).view(2, 4, 3, 3).requires_grad_(True)
        torch.manual_seed(0)
        try:
            out = layer(leaf[:, 1:] if view else leaf)
        except RuntimeError as err:
            return str(err), None, leaf.detach().clone()
        return None, out.detach().clone(), leaf.detach().clone()

    stock_error, stock_out, stock_after = run(make().train())
    model = nn.Sequential(make()).train()
    conversion = convert(model)
    try:
        assert type(model[0]) is not type(make())  # converted
        error, out, after = run(model)
    finally:
        revert(conversion)
    assert error == stock_error
    assert torch.equal(after, stock_after)
    if stock_error is not None:
        assert torch.equal(after, torch.linspace(-2.0, 2.0, 72).view(2, 4, 3, 3))
    else:
        assert torch.equal(out, stock_out)
