"""The fake-mode prediction against a real gloo run, rank by rank (world size 2, tiny GPT)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb.parallel import ParallelSpec
from memsave_nb.cli.gloo import cross_check, markdown_table


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_gloo_ranks_measure_what_fake_mode_predicts():
    # gloo's worker thread drops its Work objects (and their buffers) at a time that depends on
    # thread scheduling: now and then (about 1 rank-check in 16, docs/parallel.md) a buffer outlives
    # its fake-mode twin by a few events (tiny GPT: +68,608 B, 3.2%). Every attempt must be within 5% and never under the
    # prediction; one of up to three attempts must be exact on every rank.
    tables = []
    for _attempt in range(3):
        rows = cross_check("tiny-gpt", ParallelSpec(world_size=2))
        tables.append(markdown_table(rows))
        assert [r.rank for r in rows] == [0, 1]
        for r in rows:
            # gloo reduce-scatters by all-reducing a full-size copy of the input (NCCL and the fake
            # backend make none); without those copies the real rank's peak is the prediction
            assert r.staging_bytes > 0
            assert r.predicted_bytes <= r.comparable_bytes <= r.predicted_bytes * 1.05, tables[-1]
            assert r.measured_bytes >= r.predicted_bytes
            assert r.predicted_split["sharded_parameters"] > 0 and r.predicted_split["communication"] > 0
        assert not dist.is_initialized()
        if all(r.comparable_bytes == r.predicted_bytes for r in rows):
            break
    else:
        pytest.fail("no attempt was byte-exact:\n" + "\n".join(tables))


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_gloo_classic_ddp_ranks_measure_what_fake_mode_predicts():
    """Classic DDP on real gloo (its default all-reduce, init_sync) against fake mode, byte for byte.

    gloo's worker thread frees a Work's buffers at a time that depends on scheduling (see above):
    under load a rank can read high, never low; one of up to three attempts must be exact."""
    tables = []
    for _attempt in range(3):
        rows = cross_check("tiny-gpt", ParallelSpec(world_size=2, strategy="ddp"))
        tables.append(markdown_table(rows))
        for r in rows:
            assert r.staging_bytes == 0  # DDP all-reduces its buckets in place
            assert r.measured_bytes >= r.predicted_bytes, tables[-1]
            assert r.predicted_split["communication"] > 0  # the gradient buckets
        assert not dist.is_initialized()
        if all(r.measured_bytes == r.predicted_bytes and r.measured_split == r.predicted_split for r in rows):
            break
    else:
        pytest.fail("no attempt was byte-exact:\n" + "\n".join(tables))
