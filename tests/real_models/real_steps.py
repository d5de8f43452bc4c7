"""One plain training step's gradients, the oracle the plans are compared against."""

from __future__ import annotations

import torch

from memsave_nb.workload import Workload


def step_grads(workload: Workload, seed: int = 0) -> dict[str, torch.Tensor]:
    """Forward, loss and backward once (seeded: dropout draws the same masks each call); return
    ``{name: grad}`` for every parameter that got one, by ``named_parameters()`` name (a tied
    parameter once), and put each ``.grad`` back to what it was."""
    model = workload.model
    before = {id(p): p.grad for p in model.parameters()}
    torch.manual_seed(seed)
    batch = workload.make_batch()
    loss = workload.compute_loss(workload.forward(batch))
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = before[id(p)]
    return grads


def assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
