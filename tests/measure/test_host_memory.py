"""``Measurement.host``: the host bytes offload regions hold, against counts made by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.measure.result import HostMemory
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.offload import track_offload
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

B, D, H0, H = 8, 16, 32, 64


def _mlp() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H0), nn.Sequential(nn.Linear(H0, H), nn.ReLU(), nn.Linear(H, D)))
    return Workload(model=model, batch=torch.randn(B, D), loss=lambda out: out.pow(2).mean(), optimizer="sgd")


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_host_bytes_are_the_offloaded_regions_saved_tensors_by_hand(mode):
    """Region "1" saves: the first Linear's input (B x H0; its weight.t() stays, a parameter), the
    ReLU's output (B x H) and the same output again as the second Linear's input: three copies."""
    wl = _mlp()
    base = measure(wl, mode=mode, repeats=0)
    before = ModelSnapshot.capture(wl.model)
    with Plan(regions={"1": "offload"}).apply(wl) as applied:
        m = measure(applied, mode=mode, repeats=0)
    assert before.differences(wl.model) == []
    copies = 4 * (B * H0 + 2 * B * H)  # 5,120 B
    assert m.host == HostMemory(peak_bytes=copies, to_host_bytes=copies, to_device_bytes=copies, tensors=3)
    assert base.host == HostMemory()  # nothing offloaded: zero, not absent
    # device: the two storages leave it once each; the host holds the shared one twice
    storages = 4 * (B * H0 + B * H)  # 3,072 B
    assert base.end_of_forward.total - m.end_of_forward.total == storages
    assert m.end_of_forward.total + m.host.peak_bytes == base.end_of_forward.total + 4 * B * H
    assert m.peak_bytes <= base.peak_bytes


def test_each_step_counts_its_own_tensors_and_the_global_ledger_all():
    wl = _mlp()
    with track_offload() as ledger, Plan(regions={"1": "offload"}).apply(wl) as applied:
        first = measure(applied, mode="real", repeats=2, first_step_peak=True)
        second = measure(applied, mode="fake", repeats=0)
    assert first.host == second.host and first.host.peak_bytes == 5120
    assert ledger.peak_bytes == 5120 and ledger.live_bytes == 0
    assert ledger.moved_bytes > 2 * 5120  # warm-up and timed steps too: the step's own figure is per step


def _saved_copies(model: nn.Module, block: str, wl: Workload) -> tuple[int, int]:
    """Independent count on a plain step: bytes and tensors autograd saves inside ``block``, each
    saved tensor once per save (parameters and their views excluded), as the offload copies them."""
    params = {id(p) for p in model.parameters()}
    total, n = [0], [0]

    def pack(t):
        if id(t) not in params and not (t._base is not None and id(t._base) in params):
            total[0] += t.numel() * t.element_size()
            n[0] += 1
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    mod = model.get_submodule(block)
    handles = [
        mod.register_forward_pre_hook(lambda *a: hooks.__enter__()),
        mod.register_forward_hook(lambda *a: hooks.__exit__(None, None, None)),
    ]
    try:
        wl.compute_loss(wl.forward(wl.make_batch())).backward()
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None
    return total[0], n[0]


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_tiny_llama_with_one_block_offloaded(mode):
    pytest.importorskip("transformers")
    from .hf_models import llama

    wl = llama(batch=2, seq=32)
    block = "model.layers.1"
    expected, tensors = _saved_copies(wl.model, block, wl)
    base = measure(wl, mode=mode, repeats=0)
    with Plan(regions={block: "offload"}).apply(wl) as applied:
        m = measure(applied, mode=mode, repeats=0)
    assert tensors > 10 and expected > 0
    assert m.host == HostMemory(expected, expected, expected, tensors)
    freed = base.end_of_forward.total - m.end_of_forward.total
    assert 0 < freed <= m.host.peak_bytes  # a storage saved twice leaves the device once
    assert m.peak_bytes < base.peak_bytes
