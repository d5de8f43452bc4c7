"""Independent ways of counting the same step: PyTorch's MemTracker and the profiler's memory timeline.

Each oracle runs the step the engine runs (fresh grads, fresh batch, optimizer made inside the
step, forward, loss, backward, optimizer step), on the same workload, and puts the model back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from memsave_nb.model_state import ModelSnapshot
from memsave_nb.workload import Workload, iter_tensors

# A marker allocation of an unmistakable size shows where forward ends in the profiler's events.
_MARK_BYTES = 7_777_777


@dataclass(frozen=True)
class OracleCount:
    peak_bytes: int
    end_of_forward_bytes: int
    peak_by_category: dict[str, int]
    end_of_forward_by_category: dict[str, int]


def rng_state_bytes(wl: Workload) -> int:
    """Bytes of the CPU generator states checkpointing stashes in one forward (one per region with
    ``preserve_rng_state``), counted by calls to ``torch.get_rng_state``. MemTracker and the
    profiler's tensor-identity categories do not see them (C++ copies them below the dispatcher)."""
    original, calls = torch.get_rng_state, []

    def counted() -> torch.Tensor:
        state = original()
        calls.append(state.untyped_storage().nbytes())
        return state

    torch.get_rng_state = counted
    try:
        wl.compute_loss(wl.forward(wl.make_batch()))
    finally:
        torch.get_rng_state = original
    return sum(calls)


def closure_tensors(wl: Workload) -> list[torch.Tensor]:
    """Pre-existing tensors the step uses besides parameters, buffers and batch: targets the loss
    closure holds, plain tensor attributes of modules. The tracker counts them as inputs."""
    targets = getattr(wl.loss, "targets", None)
    found = [targets] if targets is not None else []
    cells = getattr(wl.loss, "__closure__", None) or ()
    found += [
        c.cell_contents for c in cells if isinstance(c.cell_contents, torch.Tensor) and c.cell_contents is not targets
    ]
    for module in wl.model.modules():
        found += [
            v for v in vars(module).values() if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
        ]
    return found


def _step(wl: Workload, at_forward_end=None) -> None:
    model = wl.model
    for p in model.parameters():
        p.grad = None
    batch = wl.make_batch()
    optimizer = wl.make_optimizer()
    output = wl.forward(batch)
    loss = wl.compute_loss(output)
    if at_forward_end is not None:
        at_forward_end()
    if wl.loop == "loss_only":
        del output
        output = None
    loss.backward()
    if wl.loop == "keep_output_backward":
        del output
        output = None
    if optimizer is not None:
        optimizer.step()
    del output, loss, optimizer, batch


def memtracker_count(wl: Workload, iterations: int = 1, tracker_cls: Any = None) -> OracleCount:
    """torch.distributed._tools.mem_tracker.MemTracker (fully trainable models only, unless
    ``tracker_cls`` skips the hooks it cannot put on frozen parameters).

    ``iterations=2``: a training loop of two steps (one optimizer, ``zero_grad`` between them as
    the workload's ``set_to_none`` says); ``reset_mod_stats()`` and a fresh ``with`` between them,
    so the peak and the end of forward are the second step's (the steady state).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    snapshot = ModelSnapshot.capture(wl.model)
    model = wl.model
    for p in model.parameters():
        p.grad = None
    batch = wl.make_batch()
    tracker = (tracker_cls or MemTracker)()
    tracker.track_external(model, *iter_tensors(batch), *closure_tensors(wl))
    forward_end: dict[str, int] = {}
    optimizer = None
    try:
        for i in range(iterations):
            if i:
                tracker.reset_mod_stats()
                for p in model.parameters():
                    if p.grad is not None:
                        if wl.set_to_none:
                            p.grad = None
                        else:
                            p.grad.zero_()
            with tracker:
                if i == 0:
                    optimizer = wl.make_optimizer()
                k = wl.accumulation_steps
                for micro in range(k):  # k x (forward, loss / k, backward), then one optimizer step
                    output = wl.forward(batch)
                    loss = wl.compute_loss(output)
                    if k > 1:
                        loss = loss / k
                    forward_end.update(_flat(tracker.get_tracker_snapshot("current")))
                    if wl.loop == "loss_only":  # as Hugging Face's Trainer: the output goes before backward
                        del output
                        output = None
                    loss.backward()
                    if micro < k - 1:
                        del output, loss
                        tracker.reset_mod_stats()  # it refuses a second root forward otherwise
                    elif wl.loop == "keep_output_backward":
                        del output
                        output = None
                if optimizer is not None:
                    optimizer.step()
                del output, loss  # the loss to the end of the step in every loop
            peak = _flat(tracker.get_tracker_snapshot("peak"))
    finally:
        del batch, optimizer
        snapshot.restore(model)
    return OracleCount(peak.get("Total", 0), forward_end.get("Total", 0), peak, forward_end)


def saved_tensors_hooks_count(wl: Workload) -> tuple[int, int]:
    """(bytes autograd saved for backward, bytes the outputs keep beyond that) after one forward,
    counted with ``saved_tensors_hooks`` over unique storages (parameters, buffers and batch
    excluded). Only for models without checkpointing: SAC's kept tensors bypass these hooks."""
    from memsave_nb.workload import iter_output_tensors

    model = wl.model
    batch = wl.make_batch()
    pre = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(), *iter_tensors(batch)]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in pre:
            saved[id(st)] = st.nbytes()
        return t.detach() if t.grad_fn is not None else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = wl.forward(batch)
        loss = wl.compute_loss(output)
    outputs = {}
    for t in iter_output_tensors((output, loss)):
        st = t.untyped_storage()
        if id(st) not in saved and id(st) not in pre:
            outputs[id(st)] = st.nbytes()
    del output, loss
    return sum(saved.values()), sum(outputs.values())


def _flat(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for k, v in per_device.items():
            key = getattr(k, "value", k)
            out[key] = out.get(key, 0) + v
    return out


def profiler_count(wl: Workload) -> OracleCount:
    """The profiler's memory timeline (allocator events), tensors only.

    Allocations with no tensor identity (kernel scratch space such as oneDNN workspaces) are
    left out: no dispatch-level tool can see them, so they are not "the same storages".
    """
    from torch.profiler import profile
    from torch.profiler._memory_profiler import Action, TensorKey

    snapshot = ModelSnapshot.capture(wl.model)

    def mark() -> None:
        marker = torch.empty(_MARK_BYTES, dtype=torch.uint8)
        del marker

    try:
        with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
            _step(wl, mark)
    finally:
        snapshot.restore(wl.model)
    memory_profile = prof._memory_profile()
    live = peak = 0
    forward_end = None
    by_category: dict[str, int] = {}
    peak_by_category: dict[str, int] = {}
    forward_end_by_category: dict[str, int] = {}
    for _t, action, (key, version), nbytes in memory_profile.timeline:
        if nbytes == _MARK_BYTES or nbytes == -_MARK_BYTES:
            if action == Action.CREATE and forward_end is None:
                forward_end, forward_end_by_category = live, dict(by_category)
            continue
        if not isinstance(key, TensorKey) or key.device.type != "cpu":
            continue
        category = memory_profile._categories.get(key, version)
        name = category.name.lower() if category is not None else "unknown"
        if action in (Action.PREEXISTING, Action.CREATE):
            live += nbytes
            by_category[name] = by_category.get(name, 0) + nbytes
        elif action == Action.DESTROY:
            live -= nbytes
            by_category[name] = by_category.get(name, 0) - nbytes
        elif action == Action.INCREMENT_VERSION:  # same bytes, maybe another category
            after = memory_profile._categories.get(key, version + 1)
            after_name = after.name.lower() if after is not None else "unknown"
            by_category[name] = by_category.get(name, 0) - nbytes
            by_category[after_name] = by_category.get(after_name, 0) + nbytes
        if live > peak:
            peak, peak_by_category = live, dict(by_category)
    assert forward_end is not None, "the forward-end marker was not seen by the profiler"
    return OracleCount(peak, forward_end, peak_by_category, forward_end_by_category)


def frozen_aware_memtracker() -> type:
    """MemTracker that puts its gradient hooks on trainable parameters only: torch 2.13 raises
    "cannot register a hook on a tensor that doesn't require gradient" on a frozen one (LoRA)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # type: ignore[override]
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:

                        def on_grad(grad: torch.Tensor) -> None:
                            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(on_grad),
                            p.register_post_accumulate_grad_hook(lambda q, f=on_grad: f(q.grad)),
                        )
            return memory

    return FrozenAwareMemTracker


def memtracker_on_snippet(wl: Workload, plan: Any, tracker_cls: Any = None) -> int:
    """MemTracker's peak of step 2 of the training loop ``plan.to_code(loop=wl.loop)`` writes: the
    snippet is executed on the workload's model and its own ``training_step`` runs twice (the first
    makes the optimizer's state). Without knobs the snippet builds no optimizer: the workload's is used.
    The model is put back afterwards."""
    from torch.distributed._tools.mem_tracker import MemTracker

    snapshot = ModelSnapshot.capture(wl.model)
    namespace: dict[str, Any] = {"model": wl.model}
    try:
        exec(compile(plan.to_code(loop=wl.loop), "<plan>", "exec", dont_inherit=True), namespace)  # noqa: S102
        model = namespace["model"]
        for p in model.parameters():
            p.grad = None
        optimizer = namespace.get("optimizer") or wl.make_optimizer()
        set_to_none = namespace.get("set_to_none", True)
        micro = [wl.make_batch() for _ in range(namespace.get("accumulation_steps", 1))]
        micro = [micro[0]] * len(micro)  # the engine's micro-steps use one batch
        step = namespace["training_step"]
        step(model, micro, optimizer, loss_fn=wl.compute_loss, set_to_none=set_to_none)
        tracker = (tracker_cls or MemTracker)()
        tracker.track_external(model, optimizer, *iter_tensors(micro[0]), *closure_tensors(wl))
        with tracker:
            step(model, micro, optimizer, loss_fn=wl.compute_loss, set_to_none=set_to_none)
        peak = _flat(tracker.get_tracker_snapshot("peak"))
        del optimizer, micro, namespace
    finally:
        snapshot.restore(wl.model)
    return peak.get("Total", 0)
