"""Activation offloading: a region kind beside none / full / selective."""

from __future__ import annotations

import copy

import pytest
import torch

from memsave_nb import zoo
from memsave_nb.checkpointing import RegionKind
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.offload import LINKS, track_offload, transfer_seconds
from memsave_nb.plan import Plan

REGIONS = ("blocks.0", "blocks.1")


def _saved_in(model, names):
    """Independent count: unique storages autograd saves inside ``names``, parameters excluded."""
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []
    copied = [0]

    def pack(t):
        if id(t) not in params and not (t._base is not None and id(t._base) in params):
            storage = t.untyped_storage()
            key = storage._cdata
            seen.setdefault(key, storage.nbytes())
            copied[0] += t.numel() * t.element_size()
            keep.append(t)  # hold it: a freed storage's address could be reused
        return t

    handles, contexts = [], {}
    for name in names:
        mod = model.get_submodule(name)

        def pre(m, args, name=name):
            contexts[name] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            contexts[name].__enter__()

        def post(m, args, out, name=name):
            contexts.pop(name).__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return seen, copied, handles


def _grads(wl):
    for p in wl.model.parameters():
        p.grad = None
    batch = wl.make_batch()
    wl.compute_loss(wl.forward(batch)).backward()
    grads = [p.grad.clone() for p in wl.model.parameters()]
    for p in wl.model.parameters():
        p.grad = None
    return grads


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_offload_takes_saved_bytes_off_the_device_peak(mode):
    wl = zoo.gpt(zoo.GPTConfig(dropout=0.0), batch_size=2)
    base = measure(wl, mode="real", repeats=0)
    seen, copied, handles = _saved_in(wl.model, REGIONS)
    try:
        _grads(wl)
    finally:
        for h in handles:
            h.remove()
    oracle = sum(seen.values())
    before = ModelSnapshot.capture(wl.model)
    with track_offload() as ledger, Plan(regions={r: "offload" for r in REGIONS}).apply(wl) as applied:
        m = measure(applied, mode=mode, repeats=0)
    assert before.differences(wl.model) == []
    assert base.saved_bytes - m.saved_bytes == oracle  # device: each storage freed once
    assert ledger.peak_bytes == copied[0] > oracle  # host: every saved tensor copied (views one by one)
    assert base.end_of_forward.total - m.end_of_forward.total == oracle
    assert m.peak_bytes <= base.peak_bytes


def test_offload_keeps_gradients_and_exports_code():
    wl = zoo.gpt(zoo.GPTConfig(dropout=0.0), batch_size=2)
    expected = _grads(wl)
    plan = Plan(regions={"blocks.1": "offload"})
    with plan.apply(wl) as applied:
        assert all(torch.equal(a, b) for a, b in zip(_grads(applied), expected))
    fresh = copy.deepcopy(wl.model)
    code = plan.to_code()
    assert "saved_tensors_hooks(pack, unpack)" in code and "offload_region(model.get_submodule('blocks.1'))" in code
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"model": fresh})
    assert "forward" in fresh.blocks[1].__dict__
    assert all(torch.equal(a, b) for a, b in zip(_grads(wl.replace(model=fresh)), expected))


def test_offload_is_plain_data_and_transfer_time():
    plan = Plan(regions={"blocks.0": "offload"})
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.regions["blocks.0"].kind is RegionKind.OFFLOAD
    assert transfer_seconds(64 * 10**9, "pcie5") == pytest.approx(2.0)
    assert LINKS["nvlink-c2c"].bytes_per_second > LINKS["pcie5"].bytes_per_second > LINKS["pcie4"].bytes_per_second


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: the allocator's peak")
def test_offload_on_cuda_lowers_the_allocator_peak():  # pragma: no cover - GPU machines
    wl = zoo.gpt(zoo.GPTConfig(dropout=0.0), batch_size=4, device="cuda")
    base = measure(wl, mode="real", repeats=0)
    with Plan(regions={f"blocks.{i}": "offload" for i in range(4)}).apply(wl) as applied:
        m = measure(applied, mode="real", repeats=0)
    assert m.cuda_peak_bytes < base.cuda_peak_bytes
    assert abs((base.cuda_peak_bytes - m.cuda_peak_bytes) - (base.peak_bytes - m.peak_bytes)) < 2**20
