"""Tensor parallel's collective buffers (DTensor's redistributions of activations and their
gradients) booked under "communication", as FSDP2's all-gather and reduce-scatter buffers are;
one that backward keeps stays an activation (sequence parallel's gathered inputs). Real gloo ranks
book the same split (``test_tp.py::test_real_gloo_ranks_measure_what_fake_mode_predicts``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.parallel import ParallelSpec, measure_parallel
from memsave_nb.workload import Workload

B, D, H = 256, 8, 16  # batch, model width, hidden width
SPREAD = 64  # the tail's repeat factor


class Spread(nn.Module):
    """A wide temporary made from the row-wise layer's all-reduced output without saving it, so the
    step peaks while that buffer (and nothing else TP makes) is alive."""

    def forward(self, y):
        return y.repeat(1, SPREAD).sum(-1, keepdim=True)


def row_wise_mlp() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D), Spread())
    return Workload(model, torch.randn(B, D), name="row-wise-mlp", optimizer="sgd")


@pytest.mark.parametrize("tp", [2, 4])
def test_the_row_wise_all_reduce_output_is_communication(tp):
    """Column-wise Linear(8, 16), ReLU, row-wise Linear(16, 8): the row-wise layer's partial sums
    are all-reduced into one (256, 8) float32 buffer, whatever the degree: 256 x 8 x 4 = 8,192 B,
    alive at the peak (the tail's repeat) and not kept for backward. Before, it read as a temporary."""
    spec = ParallelSpec(world_size=tp, tensor_parallel=tp, tp_plan=(("0", "colwise"), ("2", "rowwise")))
    rank = measure_parallel(row_wise_mlp(), spec).worst
    all_reduce = B * D * 4
    assert rank.collectives == (("_c10d_functional.all_reduce", tp, 1, all_reduce),)
    assert rank.peak_phase == "forward"
    assert rank.peak_split["communication"] == all_reduce
    # what else is alive at that moment, each from the shapes: the repeat's output, the batch, the
    # ReLU's output (the row-wise layer's saved input, split over the degree), the output, the weights
    assert rank.peak_split["temporaries"] == B * D * SPREAD * 4
    assert rank.peak_split["inputs"] == B * D * 4
    assert rank.peak_split["activations"] == B * (H // tp) * 4 + B * 4
    assert rank.peak_split["sharded_parameters"] == ((D + 1) * H // tp + H // tp * D + D) * 4
    assert rank.peak_bytes == sum(rank.peak_split.values())
