"""A fits verdict whose uncapped replay reserves more than the card (torch frees cached segments
when an allocation fails and retries, so the replay under the card's size fits): the text says so
plainly instead of "fits (80.9 GiB of 80.0 GiB ...)", which read as a contradiction."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.measure.cuda_allocator import Settings
from memsave_nb.measure.reserved import run_ops
from memsave_nb.measure.result import ReservedMemory
from memsave_nb.target import CUDA_CONTEXT_BYTES, Target, fit_of
from memsave_nb.units import format_bytes
from memsave_nb.workload import Workload

MiB = 1 << 20


def _slivers():
    """Each step keeps a quarter of a buffer 3 MiB larger than the last: uncapped, fixed segments
    fill with slivers (674 MiB reserved for 278.25 MiB of tensors)."""
    ops, k = [], 0
    for i in range(6):
        s = (100 + 3 * i) * MiB
        ops += [(k, s // 4, 0), (k + 1, s, 0), (k + 1, 0, 0)]
        k += 2
    alloc, _ = run_ops(ops, Settings())
    assert (alloc.stats.max_reserved, alloc.stats.max_allocated) == (674 * MiB, 278 * MiB + MiB // 4)
    torch.manual_seed(0)
    wl = Workload(nn.Linear(8, 8), torch.randn(4, 8), loss=lambda out: out.sum(), optimizer="sgd")
    m = measure(wl, "fake", repeats=1, flops=False)
    r = ReservedMemory(alloc.stats.max_reserved, alloc.stats.max_allocated, 0, 0, 0, (), "", tuple(ops))
    return dataclasses.replace(m, reserved=r)


def test_the_verdict_names_the_allocations_and_the_line_not_a_total_over_the_card():
    m = _slivers()
    target = Target((500 + 360) / 1024)  # 360 MiB beside the context: 674 MiB uncapped does not
    fit = fit_of(target, m)
    assert fit.fits and fit.replay.frees_cache
    assert fit.replay.total_bytes > target.total_bytes  # the figure the old text put "of" the card
    text = fit.verdict(target)
    line = target.total_bytes - CUDA_CONTEXT_BYTES
    assert text.startswith(
        f"fits: peak allocated {format_bytes(278 * MiB + MiB // 4)}; the allocator would free cached blocks "
        f"to stay under {format_bytes(line)}"
    ), text
    assert f"{format_bytes(fit.replay.total_bytes)} of" not in text and text.count("(") == text.count(")")
    lines = fit.replay.lines()
    assert lines[0].startswith(f"Target {target.label}: fits: peak allocated ")
    assert any("torch frees cached segments when it would run out" in s for s in lines)


def test_a_fit_within_the_card_and_a_miss_keep_the_x_of_y_form():
    m = _slivers()
    big = Target(2)  # 674 MiB + context well under 2 GB
    fit = fit_of(big, m)
    assert fit.fits and not fit.replay.frees_cache
    total = format_bytes(fit.replay.total_bytes)
    assert (
        fit.verdict(big)
        == f"fits ({total} of {format_bytes(big.total_bytes)}; allocator replay + CUDA context, no 80% rule)"
    )
    small = Target((500 + 200) / 1024)
    miss = fit_of(small, m, fixes=False)
    assert not miss.fits and not miss.replay.frees_cache
    assert miss.verdict(small).startswith(f"does not fit ({format_bytes(miss.replay.total_bytes)} of ")
