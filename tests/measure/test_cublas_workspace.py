"""The cuBLAS workspace in the replayed allocator trace of a step sized for CUDA (issue 40 part 2).

Oracle: the sizes in PyTorch's ``CublasHandlePool.cpp`` (``parseChosenWorkspaceSize``) and the
caching allocator's rules (``CUDACachingAllocator.cpp``: a request of 10 MiB or more gets its own
segment rounded to 2 MiB; below, a 20 MiB segment it can share)."""

from __future__ import annotations

import torch

from memsave_nb import measure
from memsave_nb.hub import from_pretrained
from memsave_nb.measure.cublas_workspace import workspace_bytes
from memsave_nb.measure.reserved import run_ops, settings_of
from memsave_nb.target import Target, reserved_verdict

SMALL = dict(
    overrides=dict(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    seq_len=64,
)
MIB = 2**20


def test_sizes_follow_the_gpu_and_cublas_workspace_config():
    assert workspace_bytes("h100", "") == 32 * MIB  # 4096 * 8 * 1024 on sm90+
    assert workspace_bytes("b200", "") == 32 * MIB
    assert workspace_bytes("a100", "") == 8_519_680  # :4096:2:16:8
    assert workspace_bytes("a100", ":4096:8") == 32 * MIB
    assert workspace_bytes("h100", ":16:8") == 131_072  # the deterministic-mode setting
    assert workspace_bytes("h100", ":4096:2:16:8") == 8_519_680
    assert workspace_bytes("h100", "nonsense") == 32 * MIB  # unparsable: the default


def _measure(gpu):
    wl = from_pretrained("qwen2.5-0.5b", dtype=torch.float32, **SMALL).replace(gpu=gpu)
    return wl, measure(wl, mode="fake")


def test_the_replay_reserves_the_workspace_and_the_verdict_names_it(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    wl, m = _measure("h100")
    r = m.reserved
    assert r.workspace_bytes == 32 * MIB
    without = run_ops(tuple(op for op in r.ops if op[1] != 32 * MIB), settings_of("")[0])[0].stats
    # 32 MiB >= 10 MiB: a segment of its own, exactly its size (a multiple of 2 MiB)
    assert r.max_reserved_bytes - without.max_reserved == 32 * MIB
    assert r.max_allocated_bytes - without.max_allocated == 32 * MIB
    lines = reserved_verdict(Target(80), m).lines()
    assert any(
        line.startswith("  cuBLAS workspace: 32.0 MiB, inside the predicted reserved (CublasHandlePool.cpp")
        for line in lines
    ), lines
    cpu = measure(wl.replace(sized_for=None), mode="fake")
    assert cpu.reserved.workspace_bytes == 0


def test_below_hopper_the_workspace_shares_a_20_mib_segment(monkeypatch):
    """8,519,680 B (< 10 MiB) is served from a 20 MiB large-pool segment, which later requests
    of the step can share: reserved grows by at most 20 MiB."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    _, m = _measure("a100")
    r = m.reserved
    assert r.workspace_bytes == 8_519_680
    without = run_ops(tuple(op for op in r.ops if op[1] != 8_519_680), settings_of("")[0])[0].stats
    assert 0 < r.max_reserved_bytes - without.max_reserved <= 20 * MIB
