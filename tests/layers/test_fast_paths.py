"""The speed paths of the layers give what the plain torch paths give.

- numpy bit packing (plain CPU tensors) vs the torch-op packing (dispatch modes, compilers,
  other devices): same bytes, same size;
- masks packed early (in the activation's forward, when that layer's output was left to its
  holder last time) vs late (by a later layer's compaction): same gradients, same bytes kept.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_nb.layers import _bits, _holder, convert, revert


class _Plain(TorchDispatchMode):
    """Any dispatch mode: the layers must then use torch ops only (a tracker sees them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 1000, 4099])
def test_numpy_and_torch_packing_agree(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    mask = torch.rand(3, numel, generator=gen) > 0.5
    for m in (mask, mask.t(), mask[1:], mask[:, 1:]):  # contiguous, transposed, offsets
        assert _bits.numpy_ok(m)
        fast = _bits.pack_bits(m)
        with _Plain():
            assert not _bits.numpy_ok(m)
            slow = _bits.pack_bits(m)
            slow_back = _bits.unpack_bits(slow, m.shape, torch.uint8)
        assert fast.dtype == slow.dtype == torch.uint8
        assert fast.untyped_storage().nbytes() == slow.numel() == -(-m.numel() // 8)
        assert torch.equal(fast, slow)
        fast_back = _bits.unpack_bits(fast, m.shape, torch.uint8)
        assert torch.equal(fast_back, slow_back)
        assert torch.equal(fast_back.bool(), m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bounds", [(0.0, 6.0), (-1.0, 1.0), (0.25, 0.5)])
def test_pack_inside_is_stocks_hardtanh_pass_mask(dtype: torch.dtype, bounds: tuple[float, float]) -> None:
    low, high = bounds
    x = torch.randn(1001, dtype=dtype) * 3
    x[:4] = torch.tensor([low, high, float("nan"), -0.0], dtype=dtype)
    packed = _bits.pack_inside(x, low, high)
    assert packed is not None and packed.numel() == -(-x.numel() // 8)
    passes = torch.ops.aten.hardtanh_backward(torch.ones_like(x), x, low, high) != 0
    passes[torch.isnan(x)] = False  # stock's vectorised body stops a NaN's gradient
    assert torch.equal(_bits.unpack_bits(packed, x.shape), passes)
    assert _bits.pack_inside(x.to(torch.bfloat16), low, high) is None  # torch path there
    with _Plain():
        assert _bits.pack_inside(x, low, high) is None


def _model(act: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act, nn.Conv2d(8, 4, 3, padding=1))


@pytest.mark.parametrize("act", [nn.ReLU(inplace=True), nn.ReLU6(), nn.LeakyReLU(0.1)])
def test_early_mask_same_gradients_and_bytes(act: nn.Module) -> None:
    stock = _model(act)
    x = torch.randn(2, 3, 10, 10, requires_grad=True)

    def grads(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad()
        x.grad = None
        model(x).square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    stock[2].requires_grad_(False)  # the next conv keeps nothing: the ReLU's mask is needed
    expected = grads(stock)
    conversion = convert(stock)
    try:
        layer = stock[1]
        seen: list[tuple[_holder.OutputHolder, bool]] = []  # (holder, packed in forward?)
        layer.register_forward_hook(
            lambda m, i, o: seen.append((o.grad_fn.holder, o.grad_fn.holder.packed is not None))
        )
        assert not _holder.pack_early(layer)
        assert all(torch.equal(a, b) for a, b in zip(grads(stock), expected))  # late mask
        assert seen[-1][1] is False and _holder.pack_early(layer)
        got = grads(stock)  # second step: packed in the activation's own forward
        assert seen[-1][1] is True
        assert all(torch.equal(a, b) for a, b in zip(got, expected))

        # the next conv trains now: it keeps the output, so the early mask must go
        stock[2].requires_grad_(True)
        out = stock(x)
        holder = seen[-1][0]
        assert seen[-1][1] is True  # guessed from the last step
        assert holder.output is not None and holder.packed is None  # dropped at the root
        assert not _holder.pack_early(layer)
        out.sum().backward()
    finally:
        revert(conversion)


def test_early_mask_bytes_equal_late_mask_bytes() -> None:
    model = _model(nn.ReLU())
    model[2].requires_grad_(False)
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    conversion = convert(model)
    try:
        sizes = []
        for _ in range(2):  # step 1 packs late, step 2 early
            holders: list[_holder.OutputHolder] = []
            h = model[1].register_forward_hook(lambda m, i, o: holders.append(o.grad_fn.holder))
            out = model(x)
            h.remove()
            held = holders[0]
            assert held.output is None and held.packed is not None
            sizes.append(held.packed.untyped_storage().nbytes())
            out.sum().backward()
        assert sizes == [-(-2 * 8 * 10 * 10 // 8)] * 2
    finally:
        revert(conversion)


def test_a_layers_sweep_looks_at_the_recent_holders_only_and_keeps_the_order() -> None:
    """``compact(RECENT)`` (what each layer's forward runs) shrinks the recent holders that
    nobody else keeps, leaves the older ones and the kept ones pending, in order, for the root
    sweep; ``begin_layer`` does the same sweep and refuses to hold inside saved-tensor hooks,
    where it sweeps nothing."""
    _holder.compact()  # start from nothing pending
    assert not [r for r in _holder._pending if r() is not None]
    n = _holder.RECENT + 4
    outputs = [torch.randn(16).relu() for _ in range(n)]
    holders = [_holder.OutputHolder(out) for out in outputs]
    for holder in holders:
        _holder.register(holder)
    kept = {n - 1, n - 3, 1}  # someone else still holds these outputs
    outputs = [out if i in kept else None for i, out in enumerate(outputs)]
    assert _holder.compact(_holder.RECENT) == _holder.RECENT - 2  # the recent ones not kept
    pending = [r() for r in _holder._pending]
    # the older ones untouched and first, then the kept recent ones, in registration order
    assert pending == holders[:4] + [holders[n - 3], holders[n - 1]]
    assert all(h.output is not None for h in holders[:4])
    assert all(h.output is None and h.packed is not None for i, h in enumerate(holders[4:], 4) if i not in kept)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _holder.begin_layer() is False
        assert [r() for r in _holder._pending] == pending  # nothing swept in there
    outputs = [None] * n
    assert _holder.begin_layer() is True  # 6 pending, within the window: all swept now
    assert not _holder._pending
    assert all(h.output is None and h.packed is not None for h in holders)
