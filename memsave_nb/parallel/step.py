"""One rank's training step under ``ShardTracker``, and its per-category summary.

Shared by fake mode (``measure.py``) and the real gloo ranks (``gloo.py``): the same step, the same
counting. With ``steady=True`` the first step runs untracked (it creates the optimizer state and
FSDP2's gathered-parameter storages), gradients are dropped, and the second step is measured, as
training's peak is reached from step 2 on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch
from torch import nn

from ..measure.cuda_autocast import CudaAutocast, sized_autocast
from ..measure.engine import single_tensor_default
from ..measure.optimizer_state import init_optimizer_state, make_state_on_zero_grads  # noqa: F401 - re-exported
from ..measure.tracker import INPUT
from ..measure.training_step import training_step
from ..workload import Workload, iter_tensors
from .apply import unsharded_tensors
from .host import copy_bounds, host_records
from .ddp import rebuild_buckets, reducer_storages
from .replay import replay_rank
from .result import CATEGORIES, RankMeasurement
from .tracker import ShardTracker, local_shard

_local = local_shard  # the name pipeline.py imports


def _run(
    workload: Workload, model: nn.Module, batch: Any, optimizer, tracker: ShardTracker | None, marks: dict
) -> None:
    """The engine's training step (``training_step``) on this rank's model, the same batch for
    each micro-step, the tracker's phase following the step's."""

    def on_phase(phase: str, last: bool) -> None:
        if tracker is not None:
            tracker.phase = "forward" if phase == "loss" else phase

    def forward_end(output: Any, loss: torch.Tensor) -> None:
        if tracker is not None:
            marks["forward_end"] = len(tracker.events)
            marks["live"] = set(tracker.live_records())

    forward = workload.forward if model is workload.model else functools.partial(_call, workload, model)
    left = training_step(
        workload,
        lambda last: batch,
        optimizer,
        runner="per_rank",
        forward=forward,
        on_phase=on_phase,
        on_forward_end=forward_end,
    )
    del left  # the loss lives to the end of the step in every loop (a trainer logs it)


def _fsdp_lazy_init(model: nn.Module) -> None:
    get = getattr(model, "_get_fsdp_state", None)
    if get is not None:
        get()._lazy_init()


def _call(workload: Workload, model: nn.Module, batch: Any) -> Any:
    return workload.replace(model=model).forward(batch)


def tracked_step(
    workload: Workload,
    model: nn.Module,
    batch: Any,
    *,
    rank: int,
    ranks: tuple[int, ...],
    steady: bool | str = True,
    replay: bool = True,
) -> RankMeasurement:
    """Run (steady: two steps, the second tracked) and summarise one rank.

    ``workload.model`` is the sharded module whose parameters train; ``model`` is what is called
    (the same module under FSDP2, the DDP wrapper under DDP). ``steady``: True makes the optimizer
    state with one optimizer step on zero gradients, ``"full"`` runs a whole first step, False
    measures the first step. ``replay``: the device events through the allocator model
    (``RankMeasurement.reserved``). The workload's ``accumulation_steps`` and ``set_to_none`` are honoured
    as the engine honours them (the same batch for each micro-step).
    A step sized for CUDA under autocast follows CUDA's op lists (``sized_autocast``), as the engine's
    does: the warm-up and the tracked step, on fake ranks and real gloo ranks alike; the ops it
    answered in the tracked step are the result's ``autocast_ops``.
    """
    with sized_autocast(workload) as autocast:
        result = _tracked_step(
            workload, model, batch, rank=rank, ranks=ranks, steady=steady, replay=replay, autocast=autocast
        )
    if autocast is not None and autocast.ops:
        result = dataclasses.replace(result, autocast_ops=tuple(sorted(autocast.ops.items())))
    return result


def _tracked_step(
    workload: Workload,
    model: nn.Module,
    batch: Any,
    *,
    rank: int,
    ranks: tuple[int, ...],
    steady: bool | str,
    replay: bool,
    autocast: CudaAutocast | None,
) -> RankMeasurement:
    start = time.perf_counter()
    params = [p for p in workload.model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    optimizer = workload.make_optimizer() if trainable else None
    if steady is True and getattr(model, "reducer", None) is not None:
        # DDP re-buckets once, at the first forward after a backward (the next micro-step's, with
        # accumulation): a whole first step and that rebuild come before the tracked step
        steady = "full"
    if steady == "full":
        _run(workload, model, batch, optimizer, None, {})
        rebuild_buckets(model)  # DDP re-buckets at the next forward: before tracking
    elif steady and optimizer is not None:
        # The optimizer's first step on zero gradients creates the same state as a first training
        # step, at a fraction of its cost (tests check the tracked step is byte-identical). FSDP2's
        # lazy initialisation (which re-views padded shards) runs first, as the first forward would.
        _fsdp_lazy_init(workload.model)
        make_state_on_zero_grads(optimizer, trainable)
    for p in params:
        p.grad = None
    if not workload.set_to_none:  # zero_grad(set_to_none=False): zeroed gradients alive from the start
        with torch.no_grad():
            for p in trainable:
                p.grad = torch.zeros_like(p)
    tracker = ShardTracker(workload.model)
    tracker.register_tensors(params, "sharded_parameters")
    tracker.register_tensors((p.grad for p in params if p.grad is not None), "gradients")
    tracker.register_tensors((b for b in workload.model.buffers() if b is not None), "buffers")
    tracker.register_tensors(unsharded_tensors(workload.model), "unsharded_parameters")
    tracker.register_storages(reducer_storages(model), "communication")  # DDP's gradient buckets
    if optimizer is not None:
        tracker.register_tensors((t for s in optimizer.state.values() for t in iter_tensors(s)), "optimizer_state")
    tracker.register_tensors(iter_tensors(batch), INPUT)
    marks: dict = {}
    if autocast is not None:
        autocast.ops.clear()  # the tracked step's calls, not the warm-up's
    with tracker:
        _run(workload, model, batch, optimizer, tracker, marks)
        grads = {tracker.record_of(local_shard(p.grad)) for p in params if p.grad is not None}
        grads |= {tracker.record_of(local_shard(t.grad)) for t in iter_tensors(batch) if t.grad is not None}
        opt = set()
        if optimizer is not None:
            opt = {tracker.record_of(local_shard(t)) for s in optimizer.state.values() for t in iter_tensors(s)}
        unsharded = {tracker.record_of(t) for t in unsharded_tensors(workload.model)}
        host = host_records(tracker, workload.model, optimizer)  # FSDP2 CPU offload: what lives on the host
    kinds = categorise(tracker, grads - {None}, opt - {None}, unsharded - {None}, marks)
    staging = backend_staging(tracker, kinds)
    result = summarise(tracker, kinds, marks, rank=rank, ranks=ranks, seconds=time.perf_counter() - start, host=host)
    # the GPU's share of the step (no host storages, no gloo staging copies) through the allocator model
    if replay:
        reserved, streams = replay_rank(
            tracker, skip=set(host) | staging, workspace=_cublas_workspace(workload, tracker)
        )
        result = dataclasses.replace(result, reserved=reserved, reserved_streams=streams)
    result = dataclasses.replace(
        result,
        collectives=tuple(
            (op, size, calls, nbytes) for (op, size), (calls, nbytes) in sorted(tracker.collectives.items())
        ),
    )
    if host:
        h2d, d2h = copy_bounds(workload.model)
        result = dataclasses.replace(result, offload_h2d_bytes=h2d, offload_d2h_bytes=d2h)
    elif optimizer is not None and single_tensor_default(optimizer):
        # under CPU offload the step runs on the host, single-tensor, as measured; on a GPU it would not
        result = dataclasses.replace(
            result,
            foreach_temp_bytes=sum(
                local_shard(p).numel() * local_shard(p).element_size()
                for g in optimizer.param_groups
                for p in g["params"]
            ),
        )
    if not staging:
        return result
    # A real backend's own staging copies: counted in ``peak_bytes``; the peak without them is kept
    # beside it, since the fake backend (and NCCL) make no such copies.
    without = summarise(tracker, kinds, marks, rank=rank, ranks=ranks, seconds=result.seconds, skip=staging, host=host)
    return dataclasses.replace(
        result,
        backend_staging_bytes=sum(tracker.records[i].nbytes for i in staging),
        peak_without_staging_bytes=without.peak_bytes,
    )


def _cublas_workspace(workload: Workload, tracker: ShardTracker) -> tuple[int, int, str] | None:
    """A step sized for CUDA reserves a cuBLAS workspace at its first matmul, placed at the start of
    forward as the single-GPU summary places it (``measure/summary.py``); None otherwise."""
    if workload.sized_for != "cuda":
        return None
    from ..measure.cublas_workspace import SOURCE, workspace_bytes

    start = next((i for i, p in enumerate(tracker.event_phase) if p == "forward"), 0)
    return workspace_bytes(workload.gpu), start, SOURCE


# A storage first met as the output of a view op was allocated below the dispatcher, where no
# Python mode sees it: inside a collective that is the backend's own buffer (gloo reduce-scatters
# by all-reducing a full-size copy of the input and takes this rank's chunk of it in ``wait()``).
_VIEW_OPS = frozenset(
    {
        "aten.chunk",
        "aten.split",
        "aten.split_with_sizes",
        "aten.narrow",
        "aten.slice",
        "aten.select",
        "aten.view",
        "aten._reshape_alias",
        "aten.as_strided",
        "aten.unbind",
        "aten.alias",
        "aten.reshape",
    }
)


def backend_staging(tracker: ShardTracker, kinds: list[str]) -> set[int]:
    return {i for i in tracker.comm_records if tracker.records[i].op in _VIEW_OPS and kinds[i] == "communication"}


def categorise(tracker: ShardTracker, grads: set, opt: set, unsharded: set, marks: dict) -> list[str]:
    """Each storage's category, decided once the step is over (first match wins)."""
    live_at_fwd_end = marks.get("live", set())
    kinds = []
    for i, rec in enumerate(tracker.records):
        if rec.kind is not None and i not in unsharded and i not in grads:
            kinds.append(rec.kind)
        elif i in grads:
            kinds.append("gradients")
        elif i in opt:
            kinds.append("optimizer_state")
        elif i in unsharded:
            kinds.append("unsharded_parameters")
        elif i in tracker.comm_records:
            kinds.append("communication")
        elif (
            i in tracker.redistribute_records and not rec.late and not (rec.phase == "forward" and i in live_at_fwd_end)
        ):
            kinds.append("communication")  # TP's collective buffers; one kept for backward is an activation
        elif rec.late:
            kinds.append(INPUT if rec.died is None else "temporaries")
        elif rec.phase == "forward" and i in live_at_fwd_end:
            kinds.append("activations")
        else:
            kinds.append("temporaries")
    return kinds


def summarise(
    tracker: ShardTracker,
    kinds: list[str],
    marks: dict,
    *,
    rank: int,
    ranks: tuple[int, ...],
    seconds: float,
    skip: set[int] = frozenset(),
    host: set[int] = frozenset(),
) -> RankMeasurement:
    """Peak and split over the step's events; with ``host`` (records in host memory under CPU
    offload) also the device peak (everything else) and its split, and the host peak."""
    live = {c: 0 for c in CATEGORIES}
    peak, peak_split, peak_phase = -1, dict(live), ""
    device = {c: 0 for c in CATEGORIES}
    device_peak, device_split, device_phase = -1, dict(device), ""
    host_live = host_peak = 0
    fwd_end = marks.get("forward_end")
    saved = 0
    preexisting = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
    for i in preexisting:
        live[kinds[i]] += tracker.records[i].nbytes
        if i in host:
            host_live += tracker.records[i].nbytes
        else:
            device[kinds[i]] += tracker.records[i].nbytes
    for e, ((idx, delta), phase) in enumerate(zip(tracker.events, tracker.event_phase)):
        if idx in skip:
            continue
        if not (idx in preexisting and delta > 0 and e == tracker.records[idx].born):
            live[kinds[idx]] += delta
            if idx in host:
                host_live += delta
            else:
                device[kinds[idx]] += delta
        total = sum(live.values())
        if total > peak:
            peak, peak_split, peak_phase = total, dict(live), phase
        if host:
            on_device = total - host_live
            if on_device > device_peak:
                device_peak, device_split, device_phase = on_device, dict(device), phase
            host_peak = max(host_peak, host_live)
        if fwd_end is not None and e == fwd_end - 1:
            saved = live["activations"]
    return RankMeasurement(
        rank=rank,
        ranks=ranks,
        peak_bytes=max(peak, 0),
        peak_split=peak_split,
        peak_phase=peak_phase,
        saved_bytes=saved,
        end_split=dict(live),
        events=len(tracker.events),
        seconds=seconds,
        **(
            dict(
                device_peak_bytes=max(device_peak, 0),
                device_peak_split=device_split,
                device_peak_phase=device_phase,
                host_peak_bytes=host_peak,
            )
            if host
            else {}
        ),
    )
