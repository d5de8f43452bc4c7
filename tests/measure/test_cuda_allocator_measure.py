"""A measured step carries the allocator model's reserved-memory prediction, real and fake alike."""

from __future__ import annotations

import torch
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.measure.reserved import replay_tracker
from memsave_nb.workload import Workload

MiB = 1 << 20


def _workload() -> Workload:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.ReLU(), nn.Linear(1024, 1024, bias=False))
    return Workload(model=m, batch=torch.randn(512, 1024), loss=lambda out: out.sum(), optimizer="sgd")


def test_measurement_predicts_reserved(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    real, fake = (measure(_workload(), mode, repeats=1, flops=False) for mode in ("real", "fake"))
    assert real.reserved == fake.reserved
    r = real.reserved
    # every storage here is 2 or 4 MiB (large pool, < 10 MiB: 20 MiB segments) but the 4-byte loss
    # (small pool, one 2 MiB segment); the large ones peak at exactly 20 MiB and tile one segment
    assert real.peak_bytes == 20 * MiB + 8
    assert r.max_allocated_bytes == 20 * MiB + 1024  # two sub-512 B storages rounded to 512 B
    assert r.max_reserved_bytes == 22 * MiB and r.segments == 2
    assert r.fragmentation_bytes == 22 * MiB - r.max_allocated_bytes
    assert len(r.reserved) == len(real.timeline) and max(r.reserved) == r.max_reserved_bytes


def test_replay_of_resize_and_conf():
    class Rec:
        def __init__(self, nbytes, born):
            self.nbytes, self.born = nbytes, born

    recs = [Rec(30 * MiB, 0), Rec(8 * MiB, 1)]
    # 30 MiB born, 8 MiB born, 8 MiB grown to 12 MiB (new block first, then the old one freed)
    events = [(0, 30 * MiB), (1, 8 * MiB), (1, 4 * MiB), (0, -30 * MiB), (1, -12 * MiB)]
    plain = replay_tracker(events, recs, conf="")
    # 30 MiB: its own segment; 8 MiB: a 20 MiB segment, split; 12 MiB takes the 12 MiB left there
    assert plain.reserved == (30 * MiB, 50 * MiB, 50 * MiB, 50 * MiB, 50 * MiB)
    assert plain.max_allocated_bytes == 50 * MiB
    grow = replay_tracker(events, recs, conf="expandable_segments:True")
    assert grow.max_reserved_bytes == 60 * MiB  # 30 MiB maps 40; 8 fits the 10 left; 12 maps 20 more
    assert grow.alloc_conf == "expandable_segments:True"
