"""A measured step carries the allocator model's reserved-memory prediction, real and fake alike."""

from __future__ import annotations

import pytest
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


def test_target_verdict_adds_the_context_to_the_replay(monkeypatch):
    from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, reserved_verdict

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    m = measure(_workload(), "fake", repeats=1, flops=False)
    assert CUDA_CONTEXT_BYTES == 500 * MiB
    fits = reserved_verdict(Target((500 + 22) / 1024), m)  # 22 MiB reserved + the context
    assert fits.fits and fits.total_bytes == 522 * MiB and not fits.fix
    assert fits.lines()[0].startswith("Target 0.509766 GB: fits (522.0 MiB of 522.0 MiB;")
    short = reserved_verdict(Target((500 + 10) / 1024), m)  # 10 MiB left: the 20 MiB of tensors do not fit
    assert not short.fits and not short.fragmentation_only
    import dataclasses

    assert reserved_verdict(Target(1), dataclasses.replace(m, reserved=None)) is None  # the 80% rule then


def test_fragmentation_alone_and_the_setting_that_fixes_it():
    """Each step keeps a quarter of a buffer 3 MiB larger than the last: fixed segments fill with
    slivers (674 MiB reserved for 278 MiB of tensors); expandable segments tile (280 MiB)."""
    import dataclasses

    from memsave_nb.measure.cuda_allocator import Settings
    from memsave_nb.measure.reserved import run_ops
    from memsave_nb.measure.result import ReservedMemory
    from memsave_nb.target import Target, reserved_verdict

    ops, k = [], 0
    for i in range(6):
        s = (100 + 3 * i) * MiB
        ops += [(k, s // 4, 0), (k + 1, s, 0), (k + 1, 0, 0)]
        k += 2
    alloc, _ = run_ops(ops, Settings())
    assert (alloc.stats.max_reserved, alloc.stats.max_allocated) == (674 * MiB, 278 * MiB + MiB // 4)
    r = ReservedMemory(alloc.stats.max_reserved, alloc.stats.max_allocated, 0, 0, 0, (), "", tuple(ops))
    m = dataclasses.replace(measure(_workload(), "fake", repeats=1, flops=False), reserved=r)
    v = reserved_verdict(Target((500 + 300) / 1024), m)  # 300 MiB beside the context
    assert not v.fits and v.fragmentation_only and v.fix == "expandable_segments:True"
    assert "fragmentation alone" in v.lines()[-1] and "expandable_segments:True fits" in v.lines()[-1]
    assert reserved_verdict(Target((500 + 360) / 1024), m).fits  # the retry frees cached segments


def test_html_report_shows_reserved_beside_allocated(tmp_path):
    from memsave_nb.report import render_report

    m = measure(_workload(), "fake", repeats=1, flops=False)
    page = render_report(m)
    assert "predicted reserved" in page and "22.0 MiB" in page
    assert "Reserved beside allocated (allocator model)" in page and "reserved (allocator model)" in page


@pytest.mark.slow
def test_report_llama_8b_lora_prints_predicted_reserved_and_no_80_percent_line(capsys):
    """Issue 40's command: the verdict is the replay's, with its parts; no 80% line anywhere."""
    from memsave_nb.cli import main

    assert main(["report", "--model", "llama-3.1-8b", "--lora", "r=16", "--target-gb", "24"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[3].startswith("Target 24 GB: does not fit (") and "no 80% rule" in lines[3]
    assert lines[4].startswith("  predicted reserved memory: ") and lines[5].startswith("  CUDA context: 500.0 MiB")
    assert "80% headroom" not in out and "the 80% rule does not apply" in out


def test_cli_target_lines_say_what_a_headroom_still_applies_to():
    import argparse

    from memsave_nb.cli.target import cli_target_lines

    m = measure(_workload(), "fake", repeats=1, flops=False)
    args = argparse.Namespace(target_gb=1.0, headroom=0.5, max_batch=False, max_seq=False)
    answer, explained = cli_target_lines(None, None, m, args)
    assert answer[0].startswith("Target 1 GB: fits (522.0 MiB of 1.0 GiB;")
    assert "the 80% rule does not apply" in explained and "--headroom applies only" in explained
    none = cli_target_lines(None, None, __import__("dataclasses").replace(m, reserved=None), args)
    assert none[0][0].startswith("Target 1 GB: fits (") and "50% headroom line" in none[1]
    assert "no allocator replay for this step" in none[1]
