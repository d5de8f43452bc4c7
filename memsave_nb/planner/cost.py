"""Per-op cost of one training step on a roofline device, attributed to phases and regions.

One pass under ``FakeTensorMode`` (shapes only, any model size): every aten op's FLOPs (PyTorch's
``flop_counter`` formulas) and bytes (its tensor inputs and outputs, each storage once per op),
turned into seconds by :meth:`Device.op_seconds`. Forward ops are attributed to the region
(a checkpointable block) they run in, so the cost of recomputing a region, or a kind of op in it,
is known without running a checkpointed step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memsave_nb.checkpointing import MATMUL_OPS
from memsave_nb.planner.roofline import Device

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.plan import Plan
    from memsave_nb.workload import Workload

__all__ = ["StepCost", "step_cost"]

_LOW = (torch.bfloat16, torch.float16)


@dataclass
class StepCost:
    """Seconds and FLOPs per phase, and each region's forward seconds split matmul / other."""

    device: Device
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    flops: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    region_forward: dict[str, dict[str, float]] = field(default_factory=dict)  # region -> {"matmul": s, "other": s}
    weight_bytes: int = 0  # parameters read once per micro-batch
    ops: dict[str, int] = field(default_factory=dict)  # phase -> op count

    @property
    def forward_backward_seconds(self) -> float:
        return self.seconds.get("forward", 0.0) + self.seconds.get("backward", 0.0)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def recompute_seconds(self, region: str, kind: str) -> float:
        """Extra backward seconds when ``region`` is checkpointed as ``kind``."""
        parts = self.region_forward.get(region, {})
        if kind == "full":
            return parts.get("matmul", 0.0) + parts.get("other", 0.0)
        if kind == "save_matmuls":
            return parts.get("other", 0.0)
        return 0.0


class _CostMode(TorchDispatchMode):
    def __init__(self, cost: StepCost):
        super().__init__()
        from memsave_nb.measure.tracker import _flop_registry

        self.cost = cost
        self.flop_fns = _flop_registry()
        self.phase = "forward"
        self.region_stack: list[str] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.prim.device.default, torch.ops.prim.layout.default):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        seen: set[int] = set()
        nbytes = 0
        low = False
        for t in tensors:
            try:
                key = id(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            if t.dtype in _LOW:
                low = True
            if key in seen:
                continue
            seen.add(key)
            nbytes += t.numel() * t.element_size()
        if func.is_view:
            nbytes = 0  # a view moves nothing
        fn = self.flop_fns.get(func._overloadpacket)
        flops = int(fn(*args, **kwargs, out_val=out)) if fn is not None else 0
        seconds = self.cost.device.op_seconds(flops, nbytes, low) if (nbytes or flops) else 0.0
        c = self.cost
        c.seconds[self.phase] = c.seconds.get(self.phase, 0.0) + seconds
        c.flops[self.phase] = c.flops.get(self.phase, 0) + flops
        c.nbytes[self.phase] = c.nbytes.get(self.phase, 0) + nbytes
        c.ops[self.phase] = c.ops.get(self.phase, 0) + 1
        if self.phase == "forward" and self.region_stack:
            parts = c.region_forward.setdefault(self.region_stack[-1], {"matmul": 0.0, "other": 0.0})
            parts["matmul" if str(func.overloadpacket) in MATMUL_OPS else "other"] += seconds
        return out


def step_cost(workload: "Workload", plan: "Plan", regions: Iterable[str], device: Device) -> StepCost:
    """The per-op cost of one step of ``workload`` under ``plan`` (a fake-mode pass; the model is
    left as it was; the model's lock is held, so a measurement on another thread waits)."""
    from memsave_nb.measure.common import model_lock
    from memsave_nb.measure.fake_model import _fake_model

    cost = StepCost(device)
    regions = list(regions)
    with model_lock(workload.model), plan.apply(workload) as wl:
        model = wl.model
        cost.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        grads_before = {id(p): p.grad for p in model.parameters()}
        mode = _CostMode(cost)
        handles = []

        def enter(name: str):
            def hook(module: Any, args: Any) -> None:
                mode.region_stack.append(name)

            return hook

        def leave(module: Any, args: Any, output: Any) -> None:
            mode.region_stack.pop()

        for name in regions:
            mod = model.get_submodule(name)
            handles.append(mod.register_forward_pre_hook(enter(name)))
            handles.append(mod.register_forward_hook(leave))
        try:
            with _fake_model(model) as fake_mode, fake_mode:
                batch = _fake_batch(wl, fake_mode)
                optimizer = wl.make_optimizer()
                with mode:
                    loss = wl.compute_loss(wl.forward(batch))  # Workload.forward applies its autocast
                    mode.phase = "backward"
                    loss.backward()
                    if optimizer is not None:
                        mode.phase = "optimizer"
                        optimizer.step()
                del loss, batch, optimizer
                for p in model.parameters():
                    p.grad = grads_before.get(id(p))
        finally:
            for h in handles:
                h.remove()
    return cost


def _fake_batch(workload: "Workload", fake_mode: Any) -> Any:
    """The workload's batch as fake tensors (a factory runs inside the fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from memsave_nb.workload import map_tensors

    raw = (
        workload.batch()
        if callable(workload.batch) and not isinstance(workload.batch, torch.Tensor)
        else workload.batch
    )
    converted = map_tensors(raw, lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t))
    return workload.replace(batch=converted).make_batch()
