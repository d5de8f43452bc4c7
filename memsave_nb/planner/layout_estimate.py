"""One candidate's estimates from the measured numbers (``layout_measure.py``): the lower bound that
decides whether a layout is measured at all, the peak at any micro-batch (a straight line between
the measured smallest and largest), the communication per collective family and the step time
(``links.py``'s ring factors over the stated links; data-parallel collectives overlap compute)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Sequence

from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.planner.layout_measure import RankSizes
from memsave_nb.planner.layout_result import LayoutCandidate
from memsave_nb.planner.layout_specs import ways
from memsave_nb.planner.links import Fabric, ring_all_gather, ring_all_reduce
from memsave_nb.planner.pp import pipeline_seconds
from memsave_nb.target import Target
from memsave_nb.vocabulary import OPTIMIZER_ALIASES, OPTIMIZER_STATE

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.plan import Plan
    from memsave_nb.workload import Workload

__all__ = ["LayoutSearch", "Timing", "DATA_PARALLEL"]

DATA_PARALLEL = ("DDP", "FSDP2", "HSDP")  # collectives that overlap compute


class Timing(NamedTuple):
    compute: float  # seconds of compute per optimizer step (the pipeline's bubble included)
    comm: tuple[tuple[str, float], ...]  # seconds per collective family
    seconds: float  # the step: compute, critical communication, what overlap does not hide


def _optimizer_state_factor(workload: "Workload", precision: str | None, plan: "Plan | None" = None) -> float:
    """Optimizer state bytes per trainable parameter byte, where known (a lower bound: 0 if not)."""
    name = plan.optimizer if plan is not None and plan.optimizer else workload.optimizer
    name = name.lower() if isinstance(name, str) else ""
    if precision == "bf16_master":
        return 0.0
    moments, bits = OPTIMIZER_STATE.get(OPTIMIZER_ALIASES.get(name, name), (0, 0))
    # a fixed-width moment over parameters at most 4 bytes wide (float32): per parameter byte, at least
    return float(moments) if bits == 0 else moments * bits / 8 / 4


@dataclass
class LayoutSearch:
    """What one search knows: the model's numbers (``sizes``), the links, the target and the batch."""

    sizes: RankSizes
    fabric: Fabric
    target: Target
    global_batch: int
    overlap: bool = True
    notes: list[str] = field(default_factory=list)

    def lower_bound(self, spec: ParallelSpec, kind: str | None, precision: str | None) -> float:
        """No step run: parameters and optimizer state live through the step, saved activations at
        the end of forward, gradients at the end of backward (at least the blocks' single-device
        saved bytes split over TP ranks; an unknown optimizer counts 0)."""
        total, trainable = self.sizes.param_bytes(precision)
        n = ways(spec)
        if spec.cpu_offload:
            total = trainable = 0
        state = (total + trainable * _optimizer_state_factor(self.sizes.workload, precision, self.sizes.start.plan)) / n
        pp = spec.pipeline_parallel
        saved = self.sizes.saved_per_block(kind, precision) / spec.tensor_parallel / pp
        if pp > 1:  # 1F1B: the first stage holds min(m, p) micro-batches of its blocks when its first backward starts
            saved *= self.global_batch // spec.data_parallel // spec.microbatches * min(spec.microbatches, pp)
        if pp > 1 and spec.data_parallel > 1 and spec.microbatches > 1:
            # PipelineStage keeps FSDP2's parameters and gradients unsharded from the first backward
            # to the last micro-batch's (pipelining/stage.py: set_reshard_after_backward(False),
            # set_requires_gradient_sync(False)): the stage's whole TP shard of both
            return state + max(saved, (total + trainable) / (pp * spec.tensor_parallel))
        return state + max(trainable / n, saved)

    def estimate_peak(
        self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, k: int, mbs: Sequence[int] = (1,)
    ) -> float:
        """Measured at the smallest and the largest micro-batch of the layout, a straight line between:
        a peak is the largest of sums that grow linearly with the batch, so the line is exact at both
        ends and above the peak in between (on the safe side). Accumulation adds the gradients held
        across micro-batches."""
        low, high = mbs[0], mbs[-1]
        a = self.sizes.rank_split(spec, kind, precision, low)
        if high == low:
            peak, split = a["peak"], a
        else:
            b = self.sizes.rank_split(spec, kind, precision, high)
            peak = a["peak"] + (mb - low) * (b["peak"] - a["peak"]) / (high - low)
            split = a if mb == low else b
        if k > 1 and not spec.cpu_offload:  # gradients held across micro-batches
            _, trainable = self.sizes.param_bytes(precision)
            peak += max(0.0, trainable / ways(spec) - split.get("gradients", 0.0))
        return peak

    def counted_payloads(
        self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, mbs: Sequence[int]
    ) -> dict[str, float]:
        """The collectives' payloads at micro-batch ``mb``: measured at the smallest and largest micro-batch
        (TP's grow with it, FSDP2's do not), a straight line between."""
        a = self.sizes.rank_split(spec, kind, precision, mbs[0])
        b = self.sizes.rank_split(spec, kind, precision, mbs[-1]) if mbs[-1] != mbs[0] else a
        t = 0.0 if mbs[-1] == mbs[0] else (mb - mbs[0]) / (mbs[-1] - mbs[0])
        keys = [key for key in {**a, **b} if key.startswith("coll:")]
        return {key: a.get(key, 0.0) + t * (b.get(key, 0.0) - a.get(key, 0.0)) for key in keys}

    def comm(self, spec: ParallelSpec, kind: str | None, mb: int, k: int) -> list[tuple[str, float]]:
        """Seconds per collective family per step from the standard sizes (parameters, a block's
        activation) and the ring factors, over the stated links: before a layout is measured (to
        decide whether to measure it) and where its run recorded no collectives."""
        sizes = self.sizes
        total: float
        trainable: float
        total, trainable = sizes.param_bytes()
        tp, node, pp = spec.tensor_parallel, self.fabric.gpus_per_node, spec.pipeline_parallel
        out: list[tuple[str, float]] = []
        if pp > 1:  # each stage gathers its share; micro-batches are the schedule's
            total, trainable, k = total / pp, trainable / pp, spec.microbatches
        if spec.strategy == "ddp":
            crosses = spec.world_size > node
            out.append(
                ("DDP all-reduce", k * ring_all_reduce(trainable, spec.world_size) / self.fabric.bandwidth(crosses))
            )
        else:
            n = spec.shard_size
            crosses = n * tp > node
            # forward gathers everything; backward again what forward resharded (the root: as the spec says)
            again = (
                0 if not spec.reshard_after_forward else total - (0 if spec.reshard_root else sizes.root_bytes(spec))
            )
            nbytes = ring_all_gather((total + again) / tp, n) + ring_all_gather(trainable / tp, n)
            out.append(("FSDP2 all-gather/reduce-scatter", k * nbytes / self.fabric.bandwidth(crosses)))
            if spec.replicate > 1:
                r = spec.replicate
                out.append(
                    ("HSDP all-reduce", k * ring_all_reduce(trainable / tp / n, r) / self.fabric.inter_bytes_per_second)
                )
            if spec.cpu_offload:
                out.append(("CPU offload copies", k * (total + trainable) / n / self.fabric.host_bytes_per_second))
        if tp > 1:
            hidden, vocab = sizes.hidden_and_vocab()
            act = mb * sizes.seq_len() * hidden * sizes.act_bytes()
            # per block 2 all-reduces forward, 2 backward, 2 more when recomputed; the embedding's
            # output (forward) and the head's input gradient (backward); the logits gathered once
            per_block = 4 + (2 if kind == "full" else 0)
            nbytes = (sizes.blocks.depth // pp * per_block + 2) * ring_all_reduce(act, tp)
            nbytes += ring_all_gather(mb * sizes.seq_len() * vocab * sizes.act_bytes(), tp)
            out.append(("TP collectives", k * nbytes / self.fabric.intra_bytes_per_second))
        if pp > 1:  # a micro-batch's hidden state, each way
            hidden, _ = sizes.hidden_and_vocab()
            sent = k * mb * sizes.seq_len() * hidden * sizes.act_bytes()
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
            sent = (
                ring_all_reduce(payload, n) if "all_reduce" in op or "allreduce" in op else ring_all_gather(payload, n)
            )
            families[name] = families.get(name, 0.0) + k * sent / bw
        out = list(families.items())
        if spec.cpu_offload:
            total, trainable = self.sizes.param_bytes()
            out.append(
                ("CPU offload copies", k * (total + trainable) / spec.shard_size / self.fabric.host_bytes_per_second)
            )
        return out

    def step_seconds(self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int) -> float:
        """One micro-batch's forward, backward and recomputation on one device, over the TP ranks."""
        cost = self.sizes.cost(kind, precision, mb)
        return sum(cost.get(p, 0.0) for p in ("forward", "backward", "recompute")) / spec.tensor_parallel

    def timing(
        self,
        spec: ParallelSpec,
        kind: str | None,
        precision: str | None,
        mb: int,
        k: int,
        comm: list[tuple[str, float]] | None = None,
    ) -> Timing:
        """One candidate's compute, communication per family and step seconds; ``comm`` defaults to
        the standard sizes (``comm``)."""
        cost = self.sizes.cost(kind, precision, mb)
        step = self.step_seconds(spec, kind, precision, mb)
        optimizer = cost.get("optimizer", 0.0) / ways(spec)
        if spec.cpu_offload:  # the step runs on the host: memory-bound, at the host's bandwidth
            optimizer *= self.sizes.device.bytes_per_second / self.fabric.host_memory_bytes_per_second
        if spec.pipeline_parallel > 1:  # the schedule's slots, idle ones included (pp.py)
            busy, bubble = pipeline_seconds(step, spec)
            step, k = busy + bubble, 1
        compute = k * step + optimizer
        comm = self.comm(spec, kind, mb, k) if comm is None else comm
        dp = sum(s for name, s in comm if name.startswith(DATA_PARALLEL))
        critical = sum(s for name, s in comm if not name.startswith(DATA_PARALLEL))
        return Timing(compute, tuple(comm), compute + critical + (max(0.0, dp - compute) if self.overlap else dp))

    def candidate(
        self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int, k: int, mbs: Sequence[int] = (1,)
    ) -> LayoutCandidate:
        pp = spec.pipeline_parallel
        k = 1 if pp > 1 else k  # PP: the schedule's micro-batches (spec.microbatches), measured as one step
        peak = self.estimate_peak(spec, kind, precision, mb, k, mbs)
        counted = self.counted_payloads(spec, kind, precision, mb, mbs)
        t = self.timing(spec, kind, precision, mb, k, self.counted_comm(spec, counted, k) if counted else None)
        bubble = pipeline_seconds(self.step_seconds(spec, kind, precision, mb), spec)[1] if pp > 1 else 0.0
        plan = self.sizes.plan_for(
            self.sizes.blocks.names, kind, precision, mb * spec.microbatches if pp > 1 else mb, k, spec
        )
        return LayoutCandidate(
            spec=spec,
            regions=kind,
            precision=precision,
            micro_batch=mb,
            accumulation=k,
            plan=plan,
            est_peak_bytes=int(peak),
            compute_seconds=t.compute,
            comm_seconds=t.comm,
            step_seconds=t.seconds,
            fits=self.target.fits(peak),
            pipeline_stages=pp,
            bubble_seconds=bubble,
        )
