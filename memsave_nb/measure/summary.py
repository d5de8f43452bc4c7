"""Summarising a tracked step into a ``Measurement``: each storage's category, the peak and its
split, the timeline, per-module and per-op rows."""

from __future__ import annotations

import statistics
from typing import Iterator

from torch import nn

from ..workload import Workload
from .advice import advice_for, autocast_advice
from .reserved import replay_tracker
from .result import CATEGORIES, Measurement, MemorySplit, ModuleStats, OpStats, Timeline
from .tracker import INPUT, MemoryTracker


def _categorise(tracker: MemoryTracker) -> list[str]:
    """Each storage's category, decided once the step is over."""
    fwd_end = tracker.forward_end.get("event")  # type: ignore[attr-defined]
    saved = set(tracker.forward_end.get("live", ()))  # type: ignore[attr-defined]
    outputs: set[int] = getattr(tracker, "output_records", set())  # set by the step runner
    saved_for_backward: set[int] = getattr(tracker, "saved_records", set())
    kinds = []
    for i, rec in enumerate(tracker.records):
        if rec.kind is not None:
            kinds.append(rec.kind)
        elif rec.late:  # made outside the tracker's view: pre-existing if it outlives the step
            kinds.append(INPUT if rec.died is None else "temporaries")
        elif i in tracker.grad_records:  # type: ignore[attr-defined]
            kinds.append("gradients")
        elif i in tracker.opt_records:  # type: ignore[attr-defined]
            kinds.append("optimizer_state")
        elif fwd_end is not None and rec.phase == "forward" and i in saved:
            # kept to the end of forward: by autograd for backward, or only by the step's outputs
            # (logits, KV cache, the loss) when the output reaches it and autograd did not save it
            kinds.append("outputs" if i in outputs and i not in saved_for_backward else "activations")
        else:
            kinds.append("temporaries")
    return kinds


def _summarise(
    tracker: MemoryTracker,
    workload: Workload,
    mode: str,
    times: list[float],
    cuda: dict,
    *,
    first_step_peak: int | None = None,
    steady_state: bool = False,
    output_parts: list[tuple[str, set[int]]] | None = None,
) -> Measurement:
    kinds = _categorise(tracker)
    live = {c: 0 for c in CATEGORIES}
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    peak, peak_index, peak_split = -1, 0, dict(live)
    phase_starts: dict[str, int] = {}
    fwd_end_split = dict(live)
    fwd_end = tracker.forward_end.get("event")  # type: ignore[attr-defined]
    # Late-seen storages that outlive the step existed before it (a target tensor held by the loss
    # closure): count them from the first event, like parameters, not from their first use.
    preexisting = {i for i, rec in enumerate(tracker.records) if rec.late and rec.died is None}
    for i in preexisting:
        live[kinds[i]] += tracker.records[i].nbytes
    for i, ((idx, delta), phase) in enumerate(zip(tracker.events, tracker.event_phase)):
        if not (idx in preexisting and delta > 0 and i == tracker.records[idx].born):
            live[kinds[idx]] += delta
        for c in CATEGORIES:
            series[c].append(live[c])
        phase_starts.setdefault(phase, i)
        total = sum(live.values())
        if total > peak:
            peak, peak_index, peak_split = total, i, dict(live)
        if fwd_end is not None and i == fwd_end - 1:
            fwd_end_split = dict(live)

    saved_by_module: dict[str, int] = {}
    saved_by_module_op: dict[tuple[str, str], int] = {}
    saved_by_op: dict[str, int] = {}
    output_by_module: dict[str, int] = {}
    for rec, kind in zip(tracker.records, kinds):
        if kind == "outputs":
            output_by_module[rec.module] = output_by_module.get(rec.module, 0) + rec.nbytes
        if kind != "activations":
            continue
        saved_by_module[rec.module] = saved_by_module.get(rec.module, 0) + rec.nbytes
        saved_by_module_op[(rec.module, rec.op)] = saved_by_module_op.get((rec.module, rec.op), 0) + rec.nbytes
        saved_by_op[rec.op] = saved_by_op.get(rec.op, 0) + rec.nbytes
    saved_total = sum(saved_by_module.values())

    output_total = sum(output_by_module.values())
    parts = _output_part_bytes(output_parts or [], tracker, kinds)
    modules = tuple(_module_rows(workload.model, tracker, saved_by_module, output_by_module))
    op_counts: dict[str, int] = {}
    for (_, op), n in tracker.op_calls.items():
        op_counts[op] = op_counts.get(op, 0) + n
    flop_counts = tracker.flop_counts  # type: ignore[attr-defined]
    ops = tuple(
        OpStats(op=op, count=op_counts.get(op, 0), saved_bytes=saved_by_op.get(op, 0), flops=flop_counts.get(op, 0))
        for op in sorted(
            set(op_counts) | set(saved_by_op) | set(flop_counts), key=lambda o: (-saved_by_op.get(o, 0), o)
        )
    )
    module_ops = tuple(
        (m, op, n, saved_by_module_op.get((m, op), 0))
        for (m, op), n in sorted(
            set(tracker.op_calls.items()) | {(k, 0) for k in saved_by_module_op if k not in tracker.op_calls}
        )
    )
    phases = tracker.event_phase
    return Measurement(
        mode=mode,
        device=str(workload.device),
        peak_bytes=max(peak, 0),
        peak_split=MemorySplit(**peak_split),
        peak_index=peak_index,
        peak_phase=phases[peak_index] if phases else "",
        saved_bytes=saved_total,
        end_of_forward=MemorySplit(**fwd_end_split),
        modules=modules,
        ops=ops,
        module_ops=module_ops,
        timeline=Timeline(
            phase=tuple(phases), by_category={c: tuple(v) for c, v in series.items()}, phase_starts=phase_starts
        ),
        step_seconds=statistics.median(times) if times else None,
        step_seconds_all=tuple(times),
        flops=sum(flop_counts.values()),
        cuda_peak_bytes=cuda.get("peak"),
        cuda_baseline_bytes=cuda.get("baseline"),
        output_bytes=output_total,
        output_parts=parts,
        first_step_peak_bytes=first_step_peak,
        steady_state=steady_state,
        advice=advice_for(parts, saved_total + output_total, max(peak, 0), workload.loop)
        + autocast_advice(workload, ops, saved_total),
        reserved=replay_tracker(
            tracker.events, tracker.records, preexisting, workspace=_cublas_workspace(workload, phase_starts)
        ),
        host=getattr(tracker, "host_memory", None),  # the step runner's offload ledger (measure/host.py)
    )


def _cublas_workspace(workload: Workload, phase_starts: dict[str, int]) -> tuple[int, int, str] | None:
    """A step sized for CUDA reserves a cuBLAS workspace at its first matmul (placed at the start
    of forward); None for any other step (a real CUDA step's own workspace predates it)."""
    if getattr(workload, "sized_for", None) != "cuda":  # the cell magic passes a plain namespace
        return None
    from .cublas_workspace import SOURCE, workspace_bytes

    return workspace_bytes(getattr(workload, "gpu", None)), phase_starts.get("forward", 0), SOURCE


def _output_part_bytes(
    parts: list[tuple[str, set[int]]], tracker: MemoryTracker, kinds: list[str]
) -> tuple[tuple[str, int], ...]:
    """Bytes each named part of the output keeps alive beyond what autograd saved (each storage
    counted once, in the first part that reaches it)."""
    seen: set[int] = set()
    out = []
    for name, records in parts:
        mine = {i for i in records if kinds[i] == "outputs"} - seen
        seen |= mine
        nbytes = sum(tracker.records[i].nbytes for i in mine)
        if nbytes:
            out.append((name, nbytes))
    return tuple(out)


ONE_PASS_SUBTREES = True  # False: each module's subtree walked by its own parameters() (bench/edit_speed.py's "before")


def _subtree_params(named: list[tuple[str, nn.Module]]) -> dict[int, tuple[int, int]]:
    """(trainable, frozen) parameter counts of each module's subtree, a tied weight once, by
    ``id(module)``: what ``mod.parameters()`` per module gives, in one pass from the leaves up.

    Why: per module, ``parameters()`` walks the whole subtree through nested generators; over
    Qwen2.5-0.5B + LoRA's 800 modules that was 230,000 generator steps per measurement."""
    ids: dict[int, set[int]] = {}
    numel: dict[int, tuple[int, bool]] = {}

    def below(mod: nn.Module, path: set[int]) -> set[int]:
        key = id(mod)
        got = ids.get(key)
        if got is not None:
            return got
        mine = set()
        for p in mod._parameters.values():
            if p is not None:
                mine.add(id(p))
                numel[id(p)] = (p.numel(), p.requires_grad)
        path.add(key)
        for child in mod._modules.values():
            if child is not None and id(child) not in path:
                mine |= below(child, path)
        path.discard(key)
        ids[key] = mine
        return mine

    out = {}
    for _, mod in named:
        subtree = below(mod, set())
        trainable = sum(numel[i][0] for i in subtree if numel[i][1])
        out[id(mod)] = (trainable, sum(numel[i][0] for i in subtree) - trainable)
    return out


def _module_rows(
    model: nn.Module, tracker: MemoryTracker, saved_own: dict[str, int], output_own: dict[str, int] | None = None
) -> Iterator[ModuleStats]:
    named = list(model.named_modules())
    output_own = output_own or {}
    rolled = _roll_up(named, saved_own)
    rolled_out = _roll_up(named, output_own)
    subtrees = _subtree_params(named) if ONE_PASS_SUBTREES else None
    for name, mod in named:
        own = list(mod._parameters.values())
        trainable = sum(p.numel() for p in own if p is not None and p.requires_grad)
        frozen = sum(p.numel() for p in own if p is not None and not p.requires_grad)
        if subtrees is not None:
            sub_trainable, sub_frozen = subtrees[id(mod)]
        else:
            distinct = list(mod.parameters())  # deduplicated: a tied weight once
            sub_trainable = sum(p.numel() for p in distinct if p.requires_grad)
            sub_frozen = sum(p.numel() for p in distinct if not p.requires_grad)
        yield ModuleStats(
            name=name,
            type_name=type(mod).__name__,
            depth=0 if name == "" else name.count(".") + 1,
            output_shape=tracker.module_output_shapes.get(name),
            trainable_params=trainable,
            frozen_params=frozen,
            saved_bytes_own=saved_own.get(name, 0),
            saved_bytes=rolled.get(name, 0),
            calls=tracker.module_calls.get(name, 0),
            is_leaf=not any(True for _ in mod.children()),
            output_bytes_own=output_own.get(name, 0),
            output_bytes=rolled_out.get(name, 0),
            trainable_params_subtree=sub_trainable,
            frozen_params_subtree=sub_frozen,
        )


def _roll_up(named: list[tuple[str, nn.Module]], own: dict[str, int]) -> dict[str, int]:
    """Bytes per module over its subtree: each module's own bytes added to it and every ancestor."""
    rolled: dict[str, int] = {name: 0 for name, _ in named}
    for name, nbytes in own.items():
        parts = name.split(".") if name else []
        rolled[""] = rolled.get("", 0) + nbytes
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in rolled:
                rolled[prefix] += nbytes
    return rolled
