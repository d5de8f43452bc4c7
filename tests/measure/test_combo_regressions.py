"""Regressions found by the random plans over Hugging Face models (tests/real_models/test_hf_plan_property.py),
each minimised to a plain torch model.

- bf16_master: the engine's backup of optimizer state made at construction (the fp32 masters) was
  counted as the step's temporaries in real mode only (fake state is not copied): real peak above fake.
- Adafactor in fake mode: its step reads ``.item()`` of fake scalars (DataDependentOutputException),
  so every fake measurement with ``optimizer="adafactor"`` failed in the optimizer phase.
- A checkpointed region's recomputation stops early in backward, leaving its modules on the
  tracker's module stack: with accumulation, the next micro-step's loss (outside the model) was
  charged to a module inside the region.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb.measure import measure
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload


def _mlp_workload() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), nn.Linear(16, 4)
    )
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    return Workload(model, x, loss=lambda out: F.cross_entropy(out, y), name="mlp")


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_bf16_master_weights_counted_once_real_equals_fake():
    wl = _mlp_workload()
    with Plan(precision="bf16_master", optimizer="sgd").apply(wl) as applied:
        real = measure(applied, "real", repeats=0, flops=False, steady_state=False)
        fake = measure(applied, "fake", flops=False, steady_state=False)
    n = _params(wl.model)
    # at the end of forward of the first step the optimizer holds exactly one fp32 master per parameter
    # (plain SGD has no state of its own) and nothing else of the engine's is alive
    assert real.end_of_forward.optimizer_state == 4 * n
    assert real.end_of_forward.temporaries == 0
    assert (real.peak_bytes, real.peak_split, real.end_of_forward) == (
        fake.peak_bytes,
        fake.peak_split,
        fake.end_of_forward,
    )


def test_adafactor_measures_in_fake_mode_as_in_real_mode():
    wl = _mlp_workload()
    for steady in (False, True):
        with Plan(optimizer="adafactor").apply(wl) as applied:
            real = measure(applied, "real", repeats=0, flops=False, steady_state=steady)
            fake = measure(applied, "fake", flops=False, steady_state=steady)
        assert real.peak_split.optimizer_state > 0
        assert (fake.peak_bytes, fake.peak_split, fake.first_step_peak_bytes) == (
            real.peak_bytes,
            real.peak_split,
            real.first_step_peak_bytes,
        )
    assert "item" not in torch.Tensor.__dict__  # the fake-scalar answer is gone after the step


def test_accumulated_loss_is_not_charged_to_a_recomputed_region():
    wl = _mlp_workload()
    rows = {}
    for k in (1, 2):
        with Plan(regions={"1": "full"}, accumulation_steps=k).apply(wl) as applied:
            m = measure(applied, "real", repeats=0, flops=False, steady_state=False)
        rows[k] = {r.name: r.saved_bytes_own for r in m.modules}
    # the last micro-step keeps what a single step keeps, module by module; what the cross-entropy
    # saves belongs to no module (the root's own row): its log-softmax (6 x 4 float32) and nll_loss's
    # total_weight (one float32)
    assert rows[1][""] == 6 * 4 * 4 + 4
    assert rows[2] == rows[1]
