"""The layout planner: N GPUs of a named kind and a per-GPU target; which way to spread the
training step over them (DDP, FSDP2 with or without resharding, HSDP, FSDP2 with CPU offload,
tensor parallel x FSDP2), with which single-device choices (checkpointed blocks, precision,
micro-batches), ranked by estimated step time. See docs/planner.md, "Layouts".

How it searches, cheapest first:

1. Layouts: every ``ParallelSpec`` the GPU count allows (TP degrees within a node and dividing the
   count; pipeline stages x FSDP2 where the stages split the blocks evenly, ``pp.py``: 1F1B at the
   most micro-batches, measured by ``measure_pipeline`` on its first and last stage, the
   schedule's bubble in the time, the sends over the links).
2. A lower bound per layout, no step run: parameter, gradient and (Adam/SGD) optimizer bytes per
   rank, the blocks' saved activations per TP rank under each checkpointing kind (single-device
   shallow measurements). A layout whose bound is over the target is dropped, unmeasured.
3. Each surviving (layout, checkpointing kind, precision) is measured once per rank with
   ``measure_parallel`` in fake mode, at a micro-batch of 1, on the model cut to 3 and 4 blocks and
   extrapolated to its depth (``depth.py``: exact on the models tried). Larger micro-batches scale
   the batch-dependent part (activations, inputs, temporaries); accumulation adds the gradients
   held across micro-batches.
4. Time per candidate: the roofline per op (``cost.step_cost``, a fake pass at the micro-batch,
   extrapolated the same way) divided over TP ranks, plus the recomputation, plus communication:
   the payloads of the collectives the per-rank fake run recorded, times the ring factors, over the
   stated link bandwidths (``links.py``; the standard sizes before a layout is measured). Data-parallel
   collectives overlap compute (FSDP2 prefetches, DDP buckets): only what exceeds the compute is
   added; TP's and the offload's transfers are on the critical path and always added.
5. The Pareto front (estimated peak vs time). The fastest candidates that fit are checked in
   order with a shallow measurement at their own micro-batch until one fits: that is the chosen
   layout; ``remeasure=True`` measures it per rank at full depth with ``measure_parallel``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import Blocks, blocks_of, extrapolate
from memsave_nb.planner.links import Fabric, fabric_for, ring_all_gather, ring_all_reduce
from memsave_nb.planner.layout_args import (TP_DEGREES, check_batches, check_layout_args, check_stage_counts,
                                            micro_batches)
from memsave_nb.planner.layout_result import LayoutCandidate, LayoutResult
from memsave_nb.planner.pareto import pareto_front
from memsave_nb.planner.pp import PP_DEGREES, measured_stages, pipeline_seconds, pipeline_specs
from memsave_nb.planner.roofline import Device, device_named
from memsave_nb.planner.start_plan import StartPlan, blocks_alike, start_from
from memsave_nb.target import Target
from memsave_nb.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.workload import Workload

__all__ = ["LayoutCandidate", "LayoutResult", "check_layout_args", "plan_layout", "TP_DEGREES", "PP_DEGREES"]

REGION_KINDS = (None, "full", "save_matmuls")


def _layouts(gpus: int, fabric: Fabric, tps: Sequence[int]) -> list[ParallelSpec]:
    """Every spec searched but pipeline stages (``pp.pipeline_specs``)."""
    specs: list[ParallelSpec] = []
    if 1 in tps:
        specs.append(ParallelSpec(world_size=gpus, strategy="ddp"))
        specs.append(ParallelSpec(world_size=gpus))
        if gpus > 1:
            specs.append(ParallelSpec(world_size=gpus, reshard_after_forward=False))
            specs.append(ParallelSpec(world_size=gpus, cpu_offload=True))
        nodes = gpus // fabric.gpus_per_node
        if nodes > 1 and gpus % fabric.gpus_per_node == 0:  # HSDP: shard within a node, replicate across
            specs.append(ParallelSpec(world_size=gpus, replicate=nodes))
    for tp in tps:
        if tp > 1:
            specs.append(ParallelSpec(world_size=gpus, tensor_parallel=tp))
    return specs


def _ways(spec: ParallelSpec) -> int:
    """Ranks one copy of the parameters is split over (FSDP2 shards x TP x pipeline stages)."""
    return spec.shard_size * spec.tensor_parallel * spec.pipeline_parallel if spec.strategy == "fsdp" else 1


def _optimizer_state_factor(workload: "Workload", precision: str | None, plan: Plan | None = None) -> float:
    """Optimizer state bytes per trainable parameter byte, where known (a lower bound: 0 if not)."""
    name = (plan.optimizer if plan is not None and plan.optimizer else workload.optimizer)
    name = name if isinstance(name, str) else ""
    if precision == "bf16_master":
        return 0.0
    return {"adamw": 2.0, "adam": 2.0, "sgd_momentum": 1.0}.get(name.lower(), 0.0)


@dataclass
class _Search:
    workload: "Workload"
    gpus: int
    device: Device
    fabric: Fabric
    target: Target
    blocks: Blocks
    global_batch: int
    max_micro_batches: int
    overlap: bool
    start: StartPlan = field(default_factory=lambda: StartPlan(Plan(), REGION_KINDS, (None,), None, ""))
    notes: list[str] = field(default_factory=list)
    measurements: int = 0
    _rank: dict = field(default_factory=dict)
    _cost: dict = field(default_factory=dict)
    _saved: dict = field(default_factory=dict)
    _root: dict = field(default_factory=dict)

    # -- sizes, no step run --------------------------------------------------------------------
    def param_bytes(self, precision: str | None = None) -> tuple[int, int]:
        """Parameter bytes, all and trainable; under the bf16 precisions floating ones at 2 bytes."""
        model, plan = self.workload.model, self.start.plan
        named = list(model.named_parameters())
        trains = set(plan.trainable_parameter_names(model)) if plan.frozen or plan.trainable else None

        def size(p) -> int:
            low = precision in ("bf16", "bf16_master") and p.is_floating_point()
            return p.numel() * (min(2, p.element_size()) if low else p.element_size())

        return (sum(size(p) for _, p in named),
                sum(size(p) for n, p in named if (n in trains if trains is not None else p.requires_grad)))

    def root_bytes(self, spec: ParallelSpec) -> int:
        """Bytes of the parameters in no FSDP2 unit (the root's), which torch's default does not
        gather again in backward; 0 under pipeline stages (each stage is its own root)."""
        if spec.pipeline_parallel > 1 or spec.strategy != "fsdp":
            return 0
        key = spec.shard_modules
        if key not in self._root:
            from memsave_nb.parallel.apply import shard_units

            model = self.workload.model
            inside = {id(p) for n in shard_units(model, spec) for p in model.get_submodule(n).parameters()}
            self._root[key] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
        return self._root[key]

    def hidden_and_vocab(self) -> tuple[int, int]:
        """The block's width (the first linear's input) and the head's outputs (the last linear's)."""
        import torch.nn as nn

        first = self.workload.model.get_submodule(self.blocks.names[0]) if self.blocks.names else self.workload.model
        hidden = next((m.in_features for m in first.modules() if isinstance(m, nn.Linear)), 0)
        vocab = next((m.out_features for m in reversed(list(self.workload.model.modules())) if isinstance(m, nn.Linear)), 0)
        return hidden, vocab

    def seq_len(self) -> int:
        from memsave_nb.knobs import seq_len_of
        from memsave_nb.target import _raw_batch

        try:
            return self.start.plan.seq_len or seq_len_of(_raw_batch(self.workload)) or 1
        except Exception:  # noqa: BLE001 - a batch without tokens: one position
            return 1

    # -- measurements, cached ------------------------------------------------------------------
    def _plan(self, names: Sequence[str], kind: str | None, precision: str | None, mb: int, k: int = 1,
              spec: ParallelSpec | None = None) -> Plan:
        return self.start.with_choices({n: kind for n in names} if kind else {}, precision, mb, k, spec)

    def saved_per_block(self, kind: str | None, precision: str | None) -> float:
        """Single-device saved activations of all blocks at micro-batch 1 (for the lower bound)."""
        key = (kind, precision)
        if key not in self._saved:
            from memsave_nb.target import measure_peak

            def run(model, names):
                plan = self._plan(names, kind, precision, 1)
                m = measure_peak(self.workload.replace(model=model), plan, "fake")
                return {"saved": float(sum(m.module(n).saved_bytes for n in names))}

            self._saved[key] = extrapolate(self.workload.model, self.blocks, run)["saved"]
        return self._saved[key]

    def rank_split(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int = 1, k: int = 1) -> dict[str, float]:
        """The worst rank's device peak (key "peak") and split, at full depth."""
        key = (spec, kind, precision, mb, k)
        if key not in self._rank:
            from memsave_nb.parallel import measure_parallel, measure_pipeline

            pp = spec.pipeline_parallel  # PP: the schedule's micro-batches, each of ``mb``, from mb x m per rank

            def run(model, names):
                wl = self.workload.replace(model=model)
                if pp > 1:
                    plan = self._plan(names, kind, precision, mb * spec.microbatches)
                    m = measure_pipeline(wl, spec, plan, ranks=measured_stages(spec))
                else:
                    m = measure_parallel(wl, spec, self._plan(names, kind, precision, mb, k))
                self.measurements += 1
                w = m.worst
                split = w.device_peak_split if w.device_peak_split is not None else w.peak_split
                counted = {f"coll:{op}:{n}": float(b) for op, n, _, b in getattr(w, "collectives", ())}
                # pipeline stages: every rank's peak per micro-batch phase, each extrapolated on its own
                segments = {f"segment:{r.rank}:{label}": float(b) for r in m.ranks for label, b in r.segment_peaks}
                return {"peak": float(m.device_peak_bytes), **{c: float(v) for c, v in split.items()}, **counted, **segments}

            out = extrapolate(self.workload.model, self.blocks, run, stages=pp)
            out["peak"] = max([out["peak"], *(v for k, v in out.items() if k.startswith("segment:"))])
            self._rank[key] = out
        return self._rank[key]

    def cost(self, kind: str | None, precision: str | None, mb: int) -> dict[str, float]:
        """Single-device roofline seconds per phase at micro-batch ``mb`` and the recomputation
        ``kind`` adds (one fake pass per precision and micro-batch serves every kind)."""
        key = (precision, mb)
        if key not in self._cost:
            from memsave_nb.planner.cost import step_cost

            def run(model, names):
                c = step_cost(self.workload.replace(model=model), self._plan(names, None, precision, mb), names, self.device)
                out = dict(c.seconds)
                for k in REGION_KINDS[1:]:
                    out[f"recompute {k}"] = sum(c.recompute_seconds(n, k) for n in names)
                return out

            self._cost[key] = extrapolate(self.workload.model, self.blocks, run)
        out = dict(self._cost[key])
        out["recompute"] = out.get(f"recompute {kind}", 0.0) if kind else 0.0
        return out

    # -- estimates -----------------------------------------------------------------------------
    def lower_bound(self, spec: ParallelSpec, kind: str | None, precision: str | None) -> float:
        """No step run: parameters and optimizer state live through the step, saved activations at
        the end of forward, gradients at the end of backward (at least the blocks' single-device
        saved bytes split over TP ranks; an unknown optimizer counts 0)."""
        total, trainable = self.param_bytes(precision)
        ways = _ways(spec)
        if spec.cpu_offload:
            total = trainable = 0
        state = (total + trainable * _optimizer_state_factor(self.workload, precision, self.start.plan)) / ways
        pp = spec.pipeline_parallel
        saved = self.saved_per_block(kind, precision) / spec.tensor_parallel / pp
        if pp > 1:  # 1F1B: the first stage holds min(m, p) micro-batches of its blocks when its first backward starts
            saved *= self.global_batch // spec.data_parallel // spec.microbatches * min(spec.microbatches, pp)
        if pp > 1 and spec.data_parallel > 1 and spec.microbatches > 1:
            # PipelineStage keeps FSDP2's parameters and gradients unsharded from the first backward
            # to the last micro-batch's (pipelining/stage.py: set_reshard_after_backward(False),
            # set_requires_gradient_sync(False)): the stage's whole TP shard of both
            return state + max(saved, (total + trainable) / (pp * spec.tensor_parallel))
        return state + max(trainable / ways, saved)

    def estimate_peak(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, k: int,
                      mbs: Sequence[int] = (1,)) -> float:
        """Measured at the smallest and the largest micro-batch of the layout, a straight line between:
        a peak is the largest of sums that grow linearly with the batch, so the line is exact at both
        ends and above the peak in between (on the safe side). Accumulation adds the gradients held
        across micro-batches."""
        low, high = mbs[0], mbs[-1]
        a = self.rank_split(spec, kind, precision, low)
        if high == low:
            peak, split = a["peak"], a
        else:
            b = self.rank_split(spec, kind, precision, high)
            peak = a["peak"] + (mb - low) * (b["peak"] - a["peak"]) / (high - low)
            split = a if mb == low else b
        if k > 1 and not spec.cpu_offload:  # gradients held across micro-batches
            _, trainable = self.param_bytes(precision)
            peak += max(0.0, trainable / _ways(spec) - split.get("gradients", 0.0))
        return peak

    def counted_payloads(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int,
                         mbs: Sequence[int]) -> dict[str, float]:
        """The collectives' payloads at micro-batch ``mb``: measured at the smallest and largest micro-batch
        (TP's grow with it, FSDP2's do not), a straight line between."""
        a = self.rank_split(spec, kind, precision, mbs[0])
        b = self.rank_split(spec, kind, precision, mbs[-1]) if mbs[-1] != mbs[0] else a
        t = 0.0 if mbs[-1] == mbs[0] else (mb - mbs[0]) / (mbs[-1] - mbs[0])
        keys = [key for key in {**a, **b} if key.startswith("coll:")]
        return {key: a.get(key, 0.0) + t * (b.get(key, 0.0) - a.get(key, 0.0)) for key in keys}

    def comm(self, spec: ParallelSpec, kind: str | None, mb: int, k: int) -> list[tuple[str, float]]:
        """Seconds per collective family per step from the standard sizes (parameters, a block's
        activation) and the ring factors, over the stated links: before a layout is measured (to
        decide whether to measure it) and where its run recorded no collectives."""
        total, trainable = self.param_bytes()
        tp, node, pp = spec.tensor_parallel, self.fabric.gpus_per_node, spec.pipeline_parallel
        out: list[tuple[str, float]] = []
        if pp > 1:  # each stage gathers its share; micro-batches are the schedule's
            total, trainable, k = total / pp, trainable / pp, spec.microbatches
        if spec.strategy == "ddp":
            crosses = spec.world_size > node
            out.append(("DDP all-reduce", k * ring_all_reduce(trainable, spec.world_size) / self.fabric.bandwidth(crosses)))
        else:
            n = spec.shard_size
            crosses = n * tp > node
            # forward gathers everything; backward again what forward resharded (the root: as the spec says)
            again = 0 if not spec.reshard_after_forward else total - (0 if spec.reshard_root else self.root_bytes(spec))
            nbytes = ring_all_gather((total + again) / tp, n) + ring_all_gather(trainable / tp, n)
            out.append(("FSDP2 all-gather/reduce-scatter", k * nbytes / self.fabric.bandwidth(crosses)))
            if spec.replicate > 1:
                r = spec.replicate
                out.append(("HSDP all-reduce", k * ring_all_reduce(trainable / tp / n, r) / self.fabric.inter_bytes_per_second))
            if spec.cpu_offload:
                out.append(("CPU offload copies", k * (total + trainable) / n / self.fabric.host_bytes_per_second))
        if tp > 1:
            hidden, vocab = self.hidden_and_vocab()
            act = mb * self.seq_len() * hidden * self._act_bytes()
            # per block 2 all-reduces forward, 2 backward, 2 more when recomputed; the embedding's
            # output (forward) and the head's input gradient (backward); the logits gathered once
            per_block = 4 + (2 if kind == "full" else 0)
            nbytes = (self.blocks.depth // pp * per_block + 2) * ring_all_reduce(act, tp)
            nbytes += ring_all_gather(mb * self.seq_len() * vocab * self._act_bytes(), tp)
            out.append(("TP collectives", k * nbytes / self.fabric.intra_bytes_per_second))
        if pp > 1:  # a micro-batch's hidden state, each way
            hidden, _ = self.hidden_and_vocab()
            sent = k * mb * self.seq_len() * hidden * self._act_bytes()
            out.append(("PP send/recv", sent / self.fabric.bandwidth(spec.world_size > node)))
        return out

    def counted_comm(self, spec: ParallelSpec, counted: dict[str, float], k: int) -> list[tuple[str, float]]:
        """Seconds per collective family per step from the payloads the per-rank fake run recorded
        (``RankMeasurement.collectives``: op, group size, bytes), ring factors over the links; the
        CPU offload's copies (no collective) from the shard sizes."""
        node, tp = self.fabric.gpus_per_node, spec.tensor_parallel
        families: dict[str, float] = {}
        for key, payload in counted.items():
            _, op, size = key.split(":")
            n = int(size)
            if op.startswith("c10d.recv"):  # the other end of a send
                continue
            if op == "c10d.send":  # pipeline stages: one link, no ring; the slowest boundary paces
                name = "PP send/recv"
                families[name] = families.get(name, 0.0) + payload / self.fabric.bandwidth(spec.world_size > node)
                continue
            if op.startswith("_c10d_functional."):  # DTensor under TP: within a node
                name, bw = "TP collectives", self.fabric.intra_bytes_per_second
            elif "allreduce" in op:  # DDP's buckets, HSDP's gradient shards across replicas
                name = "DDP all-reduce" if spec.strategy == "ddp" else "HSDP all-reduce"
                bw = self.fabric.bandwidth(spec.world_size > node)
            else:  # FSDP2's all-gather and reduce-scatter over the shard dimension
                name, bw = "FSDP2 all-gather/reduce-scatter", self.fabric.bandwidth(n * tp > node)
            sent = ring_all_reduce(payload, n) if "all_reduce" in op or "allreduce" in op else ring_all_gather(payload, n)
            families[name] = families.get(name, 0.0) + k * sent / bw
        out = list(families.items())
        if spec.cpu_offload:
            total, trainable = self.param_bytes()
            out.append(("CPU offload copies", k * (total + trainable) / spec.shard_size / self.fabric.host_bytes_per_second))
        return out

    def _act_bytes(self) -> int:
        p = next(self.workload.model.parameters(), None)
        return p.element_size() if p is not None else 4

    def step_seconds(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int) -> float:
        """One micro-batch's forward, backward and recomputation on one device, over the TP ranks."""
        cost = self.cost(kind, precision, mb)
        return sum(cost.get(p, 0.0) for p in ("forward", "backward", "recompute")) / spec.tensor_parallel

    def timing(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, k: int,
               comm: list[tuple[str, float]] | None = None):
        """(compute seconds, communication per family, step seconds) of one candidate; ``comm``
        defaults to the standard sizes (``comm``)."""
        cost = self.cost(kind, precision, mb)
        step = self.step_seconds(spec, kind, precision, mb)
        optimizer = cost.get("optimizer", 0.0) / _ways(spec)
        if spec.cpu_offload:  # the step runs on the host: memory-bound, at the host's bandwidth
            optimizer *= self.device.bytes_per_second / self.fabric.host_memory_bytes_per_second
        if spec.pipeline_parallel > 1:  # the schedule's slots, idle ones included (pp.py)
            busy, bubble = pipeline_seconds(step, spec)
            step, k = busy + bubble, 1
        compute = k * step + optimizer
        comm = self.comm(spec, kind, mb, k) if comm is None else comm
        dp = sum(s for name, s in comm if name.startswith(_DATA_PARALLEL))
        critical = sum(s for name, s in comm if not name.startswith(_DATA_PARALLEL))
        return compute, tuple(comm), compute + critical + (max(0.0, dp - compute) if self.overlap else dp)

    def candidate(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, k: int,
                  mbs: Sequence[int] = (1,)) -> LayoutCandidate:
        pp = spec.pipeline_parallel
        k = 1 if pp > 1 else k  # PP: the schedule's micro-batches (spec.microbatches), measured as one step
        peak = self.estimate_peak(spec, kind, precision, mb, k, mbs)
        counted = self.counted_payloads(spec, kind, precision, mb, mbs)
        compute, comm, seconds = self.timing(spec, kind, precision, mb, k,
                                             self.counted_comm(spec, counted, k) if counted else None)
        bubble = pipeline_seconds(self.step_seconds(spec, kind, precision, mb), spec)[1] if pp > 1 else 0.0
        plan = self._plan(self.blocks.names, kind, precision, mb * spec.microbatches if pp > 1 else mb, k, spec)
        return LayoutCandidate(spec, kind, precision, mb, k, plan, int(peak), compute, comm, seconds, self.target.fits(peak),
                               pp, bubble)


_DATA_PARALLEL = ("DDP", "FSDP2", "HSDP")  # collectives that overlap compute


def plan_layout(
    workload: "Workload",
    gpus: int,
    gpu: str = "H100",
    target: Target | None = None,
    *,
    global_batch: int | None = None,
    tensor_parallel: Sequence[int] | None = None,
    pipeline_parallel: Sequence[int] | None = None,
    region_kinds: Sequence[str | None] = REGION_KINDS,
    precisions: Sequence[str | None] = (None,),
    max_micro_batches: int = 8,
    overlap: bool = True,
    remeasure: bool = True,
    check: int = 3,
    plan: Plan | None = None,
) -> LayoutResult:
    """Search layouts of ``workload`` over ``gpus`` GPUs of kind ``gpu`` (a name in
    ``roofline.GPUS``) under ``target`` (default: the GPU's memory, 80% headroom); see the module
    doc. ``global_batch`` (default: the workload's batch x ``gpus``) is split over the data-parallel
    ranks and then into micro-batches (at most ``max_micro_batches``). ``tensor_parallel`` lists
    the TP degrees (default 1, 2, 4, 8 where they divide ``gpus`` within a node; a given degree
    that does not is an error). ``pipeline_parallel``: the stage counts (default: 2, 4, 8 only if nothing
    without stages fits; those that do not split the GPUs and the blocks evenly are left out, with
    a note). ``check``: how many of the fastest fitting candidates may be
    checked by a shallow measurement before giving up. The workload's freezing (LoRA included) is
    kept as given, and so are ``plan``'s choices (``start_plan.py``: its freezing, layers, loss,
    optimizer; its checkpointing and precision when set, else searched; its batch per GPU)."""
    start = time.process_time()
    tps = check_layout_args(gpus, gpu, tensor_parallel)
    pps = check_stage_counts(pipeline_parallel)
    device, fabric = device_named(gpu), fabric_for(gpu)
    target = target if target is not None else Target(device.memory_gb, name=f"{device.name} ({device.memory_gb:g} GB)")
    if not isinstance(target, Target):
        raise PlanError(f"target must be a Target (e.g. Target(80)), got {show(target)}")
    for kind in region_kinds:
        if kind not in REGION_KINDS:
            raise PlanError(f"region kind {show(kind)}: choose from {REGION_KINDS}")
    for precision in precisions:
        if precision is not None:
            Plan(precision=precision)  # one line naming a bad precision
    from memsave_nb.knobs import batch_size_of
    from memsave_nb.target import _raw_batch

    blocks = blocks_of(workload.model)
    start_plan = start_from(plan, blocks, region_kinds, precisions)
    region_kinds, precisions = start_plan.region_kinds, start_plan.precisions
    if plan is not None:
        plan.validate(workload.model)
    per_gpu = start_plan.per_gpu_batch or batch_size_of(_raw_batch(workload))
    global_batch = per_gpu * gpus if global_batch is None else global_batch
    check_batches(global_batch, max_micro_batches)
    unlike = not blocks_alike(start_plan.plan, workload.model, blocks)
    if unlike:  # the plan treats blocks differently: the shallow cuts do not stand for the model
        blocks = Blocks("", blocks.depth, blocks.names)
    search = _Search(workload, gpus, device, fabric, target, blocks, global_batch, max_micro_batches, overlap, start_plan)
    if start_plan.words:
        search.notes.append(f"starts from the plan: {start_plan.words}")
    search.notes.append("communication: the payloads of the collectives each per-rank fake run recorded, times the "
                        "ring factors, over the stated links; before a layout is measured (to decide whether to) and "
                        "for CPU offload's copies, the standard sizes")
    if not blocks.names:
        region_kinds = (None,)
        search.notes.append("no repeated blocks: no checkpointing searched")
    elif unlike:
        search.notes.append("measured at full depth (the plan treats some blocks differently from others)")
    elif not blocks.shallow:
        search.notes.append("measured at full depth (no single list of more than 4 repeated blocks to extrapolate from)")

    def groups_for(specs: list[ParallelSpec]) -> list:  # (spec, kind, precision, mbs, per rank)
        groups: list[tuple[ParallelSpec, str | None, str | None, list[int], int]] = []
        for spec in specs:
            dp = spec.data_parallel
            if global_batch % dp:
                search.notes.append(f"{spec.describe()}: global batch {global_batch} does not split over {dp} data-parallel ranks")
                continue
            per_rank = global_batch // dp
            mbs = micro_batches(per_rank, max_micro_batches)
            if spec.pipeline_parallel > 1 and mbs:  # the most micro-batches (pp.py); 1F1B wants one per stage
                if per_rank // mbs[0] < spec.pipeline_parallel:
                    search.notes.append(f"PP {spec.pipeline_parallel}: {per_rank} per rank makes fewer micro-batches than stages")
                    continue
                spec, mbs = dataclasses.replace(spec, microbatches=per_rank // mbs[0]), mbs[:1]
            if not mbs:
                search.notes.append(f"{spec.describe()}: {per_rank} per rank needs more than {max_micro_batches} micro-batches")
                continue
            # the most memory-saving kind first
            for precision in precisions:
                for kind in sorted(region_kinds, key=lambda k: {"full": 0, "save_matmuls": 1, None: 2}[k]):
                    groups.append((spec, kind, precision, mbs, per_rank))
        return groups

    pp_specs, pp_notes = pipeline_specs(gpus, workload.model, blocks, pps, tps)
    search.notes += pp_notes
    flat = _layouts(gpus, fabric, tps) if 1 in pps else []
    if pipeline_parallel is None and flat:
        # Stages only where nothing without them fits (they pay the bubble; the 70B on 16 GPUs: 105 s
        # of search instead of 34, same choice); asked for by name, they are always searched.
        candidates, pruned = _search_groups(search, groups_for(flat))
        if any(c.fits for c in candidates):
            if pp_specs:
                search.notes.append("pipeline stages not searched: a layout without them fits "
                                    "(pipeline_parallel=(1, 2, 4, 8) or --pp 1,2,4,8 compares them)")
        else:
            more, more_pruned = _search_groups(search, groups_for(pp_specs))
            candidates, pruned = candidates + more, pruned + more_pruned
    else:
        candidates, pruned = _search_groups(search, groups_for(flat + pp_specs))
    ranked = sorted(candidates, key=lambda c: (c.step_seconds, c.est_peak_bytes))
    front = pareto_front([c for c in ranked if c.fits], key=lambda c: (c.est_peak_bytes, c.step_seconds))
    chosen = _choose(search, ranked, check)
    remeasured, remeasure_seconds = None, 0.0
    if chosen is not None and remeasure:
        from memsave_nb.parallel import measure_parallel

        begin = time.process_time()
        # from the second micro-batch on the peak no longer changes: two stand for any number
        k = min(chosen.accumulation, 2)
        if chosen.pipeline_stages > 1:  # every stage, at full depth
            from memsave_nb.parallel import measure_pipeline

            remeasured = measure_pipeline(workload, chosen.spec, chosen.plan)
        else:
            remeasured = measure_parallel(workload, chosen.spec, chosen.plan.replace(accumulation_steps=k if k > 1 else None))
        remeasure_seconds = time.process_time() - begin
    return LayoutResult(gpus, device, fabric, target, global_batch, ranked, front, chosen, remeasured, pruned,
                        search.notes, time.process_time() - start, search.measurements,
                        time.process_time() - start - remeasure_seconds, remeasure_seconds)


def _search_groups(search: _Search, groups: list) -> tuple[list[LayoutCandidate], list[str]]:
    """Measure each group (layout, checkpointing kind, precision) once, all micro-batches from it.

    Each layout's most memory-saving kind is measured (the front's low end); a less saving kind, and
    any pipeline layout, only when its fastest micro-batch could beat the fastest candidate found to
    fit (its time needs no measurement), when its lower bound fits, and when the layout's previous
    kind fitted somewhere."""
    candidates: list[LayoutCandidate] = []
    pruned: list[str] = []
    first_of = {}
    for g in groups:
        first_of.setdefault((g[0], g[2]), g[1])
    dead: set = set()  # (spec, precision) whose more saving kind fitted nowhere

    def optimistic(g) -> float:
        spec, kind, precision, mbs, per_rank = g
        return min(search.timing(spec, kind, precision, mb, per_rank // mb)[2] for mb in mbs)

    # pipeline stages are measured only where they could beat what fits (their bubble and a
    # measurement over every micro-batch make them the dearest to measure)
    firsts = [g for g in groups if first_of[(g[0], g[2])] == g[1] and g[0].pipeline_parallel == 1]
    rest = sorted((g for g in groups if g not in firsts and g[0].pipeline_parallel == 1), key=optimistic)
    stages = [g for g in groups if g[0].pipeline_parallel > 1]  # each layout's most saving kind first
    skipped = 0
    for g in firsts + rest + stages:
        spec, kind, precision, mbs, per_rank = g
        words = f"{spec.describe()}, {kind or 'no'} checkpointing"
        if (spec, precision) in dead:
            continue
        if g not in firsts:
            best = min((c.step_seconds for c in candidates if c.fits), default=float("inf"))
            if optimistic(g) >= best:
                skipped += 1
                continue
        bound = search.lower_bound(spec, kind, precision)
        if not search.target.fits(bound):
            pruned.append(f"{words}: at least {format_bytes(bound)} per GPU")
            dead.add((spec, precision))
            continue
        try:
            new = [search.candidate(spec, kind, precision, mb, per_rank // mb, mbs) for mb in mbs]
        except Exception as exc:  # noqa: BLE001 - a layout the model cannot take: a note, not the end
            search.notes.append(f"{words}: skipped ({' '.join(str(exc).split())[:160]})")
            dead.add((spec, precision))
            continue
        candidates += new
        if not any(c.fits for c in new):
            dead.add((spec, precision))
    if skipped:
        search.notes.append(f"{skipped} layout/checkpointing pairs not measured: even their fastest micro-batch is "
                            "estimated slower than a candidate that fits (the front is over those measured)")
    return candidates, pruned


def _choose(search: _Search, ranked: list[LayoutCandidate], check: int) -> LayoutCandidate | None:
    """The fastest candidate whose own micro-batch, measured (shallow, extrapolated), fits."""
    for c in [c for c in ranked if c.fits][: max(0, check)]:
        k = min(c.accumulation, 2)  # from the second micro-batch on the peak no longer changes
        peak = search.rank_split(c.spec, c.regions, c.precision, c.micro_batch, k)["peak"]
        if search.target.fits(peak):
            return dataclasses.replace(c, checked_peak_bytes=int(peak))
        search.notes.append(f"{c.label}: estimated to fit, measured {format_bytes(peak)} at its micro-batch; next")
    return None
