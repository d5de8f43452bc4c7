"""The fake-mode prediction against a real gloo run, rank by rank (world size 2, tiny GPT)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from memsave_nb.parallel import ParallelSpec
from memsave_nb.parallel.gloo import cross_check, markdown_table


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo backend not built")
def test_gloo_ranks_measure_what_fake_mode_predicts():
    rows = cross_check("tiny-gpt", ParallelSpec(world_size=2))
    assert [r.rank for r in rows] == [0, 1]
    for r in rows:
        assert r.measured_bytes == r.predicted_bytes, markdown_table(rows)
        assert r.measured_split == r.predicted_split
        assert r.measured_split["sharded_parameters"] > 0 and r.measured_split["communication"] > 0
    assert not dist.is_initialized()
