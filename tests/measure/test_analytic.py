"""The engine against byte counts worked out by hand for small models (float32, 4 bytes a number).

What autograd keeps, per module (``saved_bytes_own``): ReLU keeps its output; Linear keeps its
input only when its weight trains (the input is then another module's output, counted there);
GELU keeps its input; ``x + f(x)`` keeps nothing. The model output and the scalar loss stay alive
to the end of the step (the step holds them) but autograd did not save them (a sum loss keeps
nothing): they are outputs (``output_bytes_own``) of their module and of the root, not saved bytes.
"""

from __future__ import annotations

import pytest
import torch

from memsave_nb.measure import measure

from .cases import CASES
from .conftest import measured

F32 = 4
CASE = {c.name: c for c in CASES}

# linear_relu: x (4, 16) -> Linear(16, 32) -> ReLU -> Linear(32, 8) -> sum
LR_B, LR_A, LR_H, LR_C = 4, 16, 32, 8
LR_PARAMS = (LR_A * LR_H + LR_H + LR_H * LR_C + LR_C) * F32
# checkpointed / sac_matmuls: x (8, 16) -> inp Linear(16, 32) -> block [fc1 32->64, GELU, fc2 64->32, + skip] -> head Linear(32, 4) -> sum
CK_B, CK_D = 8, 32
# checkpoint (preserve_rng_state) stashes the CPU generator's state per region, in the caller (root)
RNG = torch.get_rng_state().untyped_storage().nbytes()

EXPECTED_SAVED_OWN: dict[str, dict[str, int]] = {
    "linear_relu": {"1": LR_B * LR_H * F32},
    # Linear(32, 8) trains: it keeps its input, the ReLU's output (counted at the ReLU, "3")
    "frozen": {"3": 4 * 32 * F32},
    "input_grad": {"1": 4 * 32 * F32},
    # eager: GELU keeps its input (fc1's output) and the next Linear its output
    "eager_block": {
        "inp": CK_B * CK_D * F32,
        "block.fc1": CK_B * 2 * CK_D * F32,
        "block.act": CK_B * 2 * CK_D * F32,
        "block": CK_B * CK_D * F32,
    },
    # checkpoint keeps the block's input (inp's output) and nothing inside the block
    "checkpointed": {"inp": CK_B * CK_D * F32, "block": CK_B * CK_D * F32, "": RNG},
    # SAC keeps the two matmul outputs as well (addmm of fc1: (8, 64), of fc2: (8, 32))
    "sac_matmuls": {
        "inp": CK_B * CK_D * F32,
        "block.fc1": CK_B * 2 * CK_D * F32,
        "block.fc2": CK_B * CK_D * F32,
        "block": CK_B * CK_D * F32,
        "": RNG,
    },
}

# What only the step's outputs keep: the model output (born in the last layer) and the loss (root).
EXPECTED_OUTPUT_OWN: dict[str, dict[str, int]] = {
    "linear_relu": {"2": LR_B * LR_C * F32, "": F32},
    "frozen": {"4": 4 * 8 * F32, "": F32},
    "input_grad": {"2": 4 * 8 * F32, "": F32},
    "eager_block": {"head": CK_B * 4 * F32, "": F32},
    "checkpointed": {"head": CK_B * 4 * F32, "": F32},
    "sac_matmuls": {"head": CK_B * 4 * F32, "": F32},
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SAVED_OWN))
def test_saved_bytes_per_module(name):
    m = measured(CASE[name])
    expected = EXPECTED_SAVED_OWN[name]
    got = {row.name: row.saved_bytes_own for row in m.modules if row.saved_bytes_own}
    assert got == expected
    assert m.saved_bytes == sum(expected.values())
    assert m.module("").saved_bytes == m.saved_bytes
    outputs = {row.name: row.output_bytes_own for row in m.modules if row.output_bytes_own}
    assert outputs == EXPECTED_OUTPUT_OWN[name]
    assert m.output_bytes == m.module("").output_bytes == sum(outputs.values())
    assert m.end_of_forward.outputs == m.output_bytes and m.end_of_forward.activations == m.saved_bytes


@pytest.mark.parametrize("loop", ["loss_only", "keep_output_backward", "keep_output_step"])
def test_linear_relu_peak_split(loop):
    """Peak in AdamW's step, updating the largest weight: every state exists, and ``sqrt`` and
    ``/`` of that weight's second moment are both alive (two weight-sized temporaries). The output
    is alive there only in the loop that keeps it through the step; the loss in every loop."""
    m = measure(CASE["linear_relu"].build().replace(loop=loop), "real", repeats=0)
    kept_output = LR_B * LR_C * F32 if loop == "keep_output_step" else 0
    n_param_tensors = 4
    split = m.peak_split
    assert m.peak_phase == "optimizer"
    assert split.parameters == LR_PARAMS
    assert split.inputs == LR_B * LR_A * F32
    assert split.gradients == LR_PARAMS
    assert split.optimizer_state == 2 * LR_PARAMS + n_param_tensors * F32  # exp_avg, exp_avg_sq, step
    assert split.activations == 0  # backward freed what autograd saved
    assert split.outputs == kept_output + F32  # (output and) loss, held until the step ends
    assert split.temporaries == 2 * max(LR_A * LR_H, LR_H * LR_C) * F32
    assert m.peak_bytes == split.total == 17300 + kept_output


def test_checkpoint_keeps_less_than_eager_and_sac_in_between():
    eager = measured(CASE["eager_block"]).saved_bytes
    full = measured(CASE["checkpointed"]).saved_bytes - RNG  # the stashed generator state: see EXPECTED_SAVED_OWN
    sac = measured(CASE["sac_matmuls"]).saved_bytes - RNG
    assert full < sac < eager
    assert sac - full == CK_B * 2 * CK_D * F32 + CK_B * CK_D * F32  # the two matmul outputs
    assert eager - full == 2 * CK_B * 2 * CK_D * F32  # fc1's output and GELU's output
