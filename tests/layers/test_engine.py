"""The project's engine (memsave_nb.measure) sees the same savings as the test-local counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb.layers import convert, revert
from memsave_nb.measure import measure
from memsave_nb.workload import Workload


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_engine_sees_relu_mask_instead_of_output(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False))
    model[1].requires_grad_(False)
    x = torch.randn(2, 4, 8, 8)
    workload = Workload(model, x, loss=lambda out: out.sum(), optimizer=None, input_requires_grad=True)
    stock = measure(workload, mode=mode, repeats=0, flops=False).saved_bytes
    conversion = convert(model)
    try:
        ours = measure(workload, mode=mode, repeats=0, flops=False).saved_bytes
    finally:
        revert(conversion)
    n = x.numel()
    # stock keeps the ReLU output (which the conv keeps too, same storage); ours its bits
    assert stock - ours == 4 * n - n // 8
