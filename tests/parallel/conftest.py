"""Shared cases for the parallel tests: small workloads, and PyTorch's FSDPMemTracker as the oracle."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from memsave_nb import zoo
from memsave_nb.workload import Workload, iter_tensors

TINY_GPT = zoo.GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=0.0)


def tiny_gpt(batch_size: int = 2) -> Workload:
    return zoo.gpt(TINY_GPT, batch_size=batch_size)


class Blocks(nn.Module):
    """Two blocks of Linear-ReLU-Linear with chosen widths (dim 0 of every parameter is a width)."""

    def __init__(self, width: int = 64, hidden: int = 128, out: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)) for _ in range(2)
        )
        self.head = nn.Linear(width, out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def blocks_workload(width: int = 64, hidden: int = 128, out: int = 64, batch: int = 16, optimizer="adamw") -> Workload:
    torch.manual_seed(0)
    model = Blocks(width, hidden, out)
    x = torch.randn(batch, width)
    return Workload(model, x, loss=lambda o: o.square().mean(), optimizer=optimizer, name="blocks")


def fsdp_mem_tracker_peak(workload: Workload, spec, plan=None, rank: int = 0, shard=None, inputs=()) -> dict:
    """PyTorch's FSDPMemTracker on the same fake setup, steady state (step 2 tracked). ``shard(model,
    mesh)``: the user's own ``fully_shard`` calls instead of ``apply_parallel``'s; ``inputs``: more
    tensors it is handed as inputs (the targets a loss closure holds)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from memsave_nb.parallel.apply import apply_parallel
    from memsave_nb.parallel.measure import _fake_batch, entries_restored
    from memsave_nb.parallel.process_group import fake_process_group
    from memsave_nb.parallel.twin import fake_twin

    with fake_process_group(spec, rank) as mesh:
        fm = FakeTensorMode(allow_non_fake_inputs=True)
        twin = fake_twin(workload.model, fm)
        w0 = workload.replace(model=twin)
        with plan.apply(w0) if plan is not None else contextlib.nullcontext(w0) as w, fm, entries_restored(twin):
            (shard or (lambda m, mesh: apply_parallel(m, spec, mesh)))(twin, mesh)
            batch = _fake_batch(w, fm)
            opt = w.make_optimizer()

            k = w.accumulation_steps

            def step():
                for micro in range(k):  # micro-steps as memsave_nb runs them: loss / k, same batch
                    out = w.forward(batch)
                    loss = w.compute_loss(out)
                    if k > 1:
                        loss = loss / k
                    if w.loop == "loss_only":  # the workload's loop: the output goes before backward
                        out = None
                    loss.backward()
                    if micro < k - 1:
                        out = loss = None
                    elif w.loop == "keep_output_backward":
                        out = None
                opt.step()
                del out, loss  # the loss lives to the end of the step
                opt.zero_grad()

            step()
            fmt = FSDPMemTracker(twin, opt)
            fmt.track_inputs(tuple(iter_tensors(batch)) + tuple(inputs))
            with fmt:
                step()
            snap = fmt.get_tracker_snapshot("peak")
    (dev_snap,) = snap.values()
    return {str(getattr(k, "value", k)): v for k, v in dev_snap.items()}


RNG_STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()


def beyond_fsdp_mem_tracker(ours: int, theirs: int, plan) -> int:
    """How many of checkpoint's stashed CPU generator states (``torch.get_rng_state()``, made below
    the dispatcher) our peak holds beyond FSDPMemTracker's, which does not see them; checks the rest
    is byte-identical and that there are no more than the plan has checkpointed regions."""
    regions = len(plan.active_regions) if plan is not None else 0
    extra = ours - theirs
    assert extra % RNG_STATE_BYTES == 0 and 0 <= extra // RNG_STATE_BYTES <= regions, (ours, theirs, regions)
    return extra // RNG_STATE_BYTES
