"""Per-rank results as frozen plain data (sizes and names, never tensors), and the lines no
dispatch-level counter can see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..measure.result import ReservedMemory
from ..parallel_spec import ParallelSpec

CATEGORIES = (
    "sharded_parameters",  # this rank's own parameter storage (its FSDP shards; DDP: the whole copy)
    "unsharded_parameters",  # FSDP2: parameters while all-gathered
    "buffers",  # module buffers (not sharded by FSDP2)
    "communication",  # collective buffers: FSDP2's all-gather / reduce-scatter, TP's redistributions
    "gradients",  # gradients kept for the optimizer (gradient shards under FSDP2)
    "optimizer_state",
    "activations",  # saved for backward (and outputs kept to the end of forward)
    "inputs",
    "temporaries",
)

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Unseen:
    """Memory a rank uses that no dispatch-level counter sees: a typical figure and its source."""

    name: str
    low_bytes: int
    high_bytes: int
    source: str


def unseen_lines(
    spec: ParallelSpec,
    peak_bytes: int,
    offload_h2d_bytes: int = 0,
    offload_d2h_bytes: int = 0,
    foreach_temp_bytes: int = 0,
    reserved_bytes: int | None = None,
) -> tuple[Unseen, ...]:
    """The explicit lines added beside every per-rank peak (figures per rank).

    ``peak_bytes`` is the device peak; under CPU offload ``offload_*_bytes`` are the upper bounds
    of the device-side copies a CPU mesh cannot show (``host.copy_bounds``), estimates.
    ``foreach_temp_bytes``: see ``RankMeasurement.foreach_temp_bytes``. ``reserved_bytes``: the
    rank's predicted reserved memory (its allocator replay); with it the fragmentation line is the
    replay's excess over the peak, not the 80% rule's 25%.
    """
    lines = []
    if foreach_temp_bytes:
        lines.append(
            Unseen(
                "optimizer step on a GPU: foreach temporaries (estimate, upper bound)",
                0,
                foreach_temp_bytes,
                "sized on CPU shards, the optimizer ran torch's single-tensor step; on CUDA, torch's default "
                "(foreach=None) picks the foreach step, whose temporaries over all parameters at once reach about "
                "the trainable shard bytes (measured on one device: +3.2 MB for 3.8 MB of parameters); transient, "
                "so 0 if not at the peak. Pass the optimizer knob 'adamw_foreach' to size that step itself",
            )
        )
    if spec.cpu_offload:
        lines.append(
            Unseen(
                "CPU offload: device copy of each shard before its all-gather (estimate, upper bound)",
                0,
                offload_h2d_bytes,
                "FSDP2 copies the host shards of a group to the device before the all-gather (_fsdp_param.py "
                "all_gather_inputs: .to(device)); on a CPU mesh that copy is a no-op. Bound: the largest group's "
                "padded shard bytes (one parameter's with a param_dtype cast); transient, so 0 if not at the peak",
            )
        )
        lines.append(
            Unseen(
                "CPU offload: device gradient shards before their copy to the host (estimate, upper bound)",
                0,
                offload_d2h_bytes,
                "FSDP2 reduce-scatters on the device and then copies the gradient shards to the host "
                "(_fsdp_collectives.py foreach_reduce: .to('cpu')); on a CPU mesh they are the host gradients. Bound: "
                "the largest group's padded shard bytes in the parameters' dtype; transient, so 0 if not at the peak",
            )
        )
    if spec.world_size > 1:
        n = spec.communicators
        lines.append(
            Unseen(
                f"communication library buffers (NCCL, {n} communicator{'s' if n > 1 else ''})",
                n * 256 * MIB,
                n * 512 * MIB,
                "about 0.5 GB per communicator is the typical published estimate; NCCL sizes its buffers by "
                "NCCL_BUFFSIZE (default 4 MiB) per channel and peer (NCCL environment-variable docs)",
            )
        )
    lines.append(
        Unseen(
            "CUDA context and kernels",
            300 * MIB,
            500 * MIB,
            "CUDA runtime context per GPU, 300-500 MB depending on driver and loaded kernels (PyTorch CUDA notes)",
        )
    )
    lines.append(
        Unseen(
            "kernel workspaces (cuBLAS; cuDNN not bounded)",
            0,
            32 * MIB,
            "memory a kernel allocates below the dispatcher. cuBLAS: one workspace per handle and stream, up to "
            "32 MiB (NVIDIA's recommendation on Hopper and later, 4 MiB before), taken from PyTorch's caching "
            "allocator. cuDNN convolutions pick a workspace per algorithm: not bounded here. On the CPU, oneDNN "
            "convolutions do the same (docs/parallel.md, 'Against the allocator's own record')",
        )
    )
    if reserved_bytes is not None:
        extra = max(reserved_bytes - peak_bytes, 0)
        lines.append(
            Unseen(
                "allocator fragmentation: rounding and cached segments (replayed)",
                extra,
                extra,
                "the rank's allocations and frees replayed through a model of torch 2.13's CUDA caching allocator "
                "(each stream's pool apart: FSDP2's all-gather and reduce-scatter): predicted max_memory_reserved less "
                "the counted peak (docs/parallel.md, 'Reserved memory per rank')",
            )
        )
        return tuple(lines)
    lines.append(
        Unseen(
            "allocator fragmentation and headroom",
            0,
            peak_bytes // 4,
            "Fujii et al. 2024 (arXiv 2411.06465, 454 runs on A100/H100): estimates below 80% of GPU memory "
            "never ran out of memory, i.e. keep up to 25% above the counted peak (no allocator replay for this rank)",
        )
    )
    return tuple(lines)


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's training step, measured on a fake (or real gloo) process group.

    ``ranks`` lists the ranks this measurement stands for: ranks whose local shards have the same
    shapes run the same program on a fake group, so one of them is measured.
    """

    rank: int
    ranks: tuple[int, ...]
    peak_bytes: int
    peak_split: dict[str, int]
    peak_phase: str
    saved_bytes: int
    end_split: dict[str, int]
    events: int
    seconds: float = 0.0
    backend_staging_bytes: int = 0  # real backends only: buffers the backend allocates itself (gloo)
    peak_without_staging_bytes: int | None = None
    # FSDP2 CPU offload only (None / 0 otherwise): ``peak_bytes`` counts host and device together;
    # these split it by where a GPU run keeps each storage (``host.py``).
    device_peak_bytes: int | None = None  # the number that decides out-of-memory on the GPU
    device_peak_split: dict[str, int] | None = None
    device_peak_phase: str = ""
    host_peak_bytes: int | None = None
    offload_h2d_bytes: int = 0  # upper bounds of the device-side copies a CPU mesh cannot show
    offload_d2h_bytes: int = 0
    # the optimizer ran torch's single-tensor step on CPU shards; a GPU's default (foreach) step
    # makes temporaries up to about this rank's trainable shard bytes (0: not the case)
    foreach_temp_bytes: int = 0
    # the collectives the tracked step ran: (op, group size, calls, payload bytes), e.g.
    # ("c10d._allgather_base_", 8, 81, ...); DDP's all-reduce runs in a comm hook on the fake
    # backend and is not among them
    collectives: tuple[tuple[str, int, int, int], ...] = ()
    # pipeline stages: the peak within each micro-batch's forward and backward and the optimizer step
    # (label, bytes), what the layout planner extrapolates over depth one by one
    segment_peaks: tuple[tuple[str, int], ...] = ()
    # the rank's device events replayed through the caching-allocator model (``replay.py``): predicted
    # ``max_memory_reserved``, fragmentation, the reserved timeline; None where no replay exists
    # (the cross-check's rebuilt ranks, the layout search's shallow twins): the 80% rule judges those
    reserved: ReservedMemory | None = field(default=None, repr=False)
    # the stream of each op in ``reserved.ops`` (FSDP2's all-gather / reduce-scatter pools); () = all default
    reserved_streams: tuple[int, ...] = field(default=(), repr=False)
    # a step sized for CUDA (``Workload.sized_for``/``gpu``): the SDPA backends CUDA would pick, with
    # their calls (forward and a checkpoint's recomputation), as ``measure/cuda_attention.py`` chose them
    attention_backends: tuple[tuple[str, int], ...] = ()
    # a step sized for CUDA under autocast: the ops that ran with CUDA's autocast policy where the CPU's
    # differs, with their calls (``measure/cuda_autocast.py``)
    autocast_ops: tuple[tuple[str, int], ...] = ()

    @property
    def device_bytes(self) -> int:
        """The device (GPU) peak: ``device_peak_bytes`` under CPU offload, else ``peak_bytes``."""
        return self.peak_bytes if self.device_peak_bytes is None else self.device_peak_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ranks": list(self.ranks),
            "peak_bytes": self.peak_bytes,
            "peak_split": dict(self.peak_split),
            "peak_phase": self.peak_phase,
            "saved_bytes": self.saved_bytes,
            "end_split": dict(self.end_split),
            "seconds": self.seconds,
            "backend_staging_bytes": self.backend_staging_bytes,
            "peak_without_staging_bytes": self.peak_without_staging_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "device_peak_phase": self.device_peak_phase,
            "device_peak_split": None if self.device_peak_split is None else dict(self.device_peak_split),
            "host_peak_bytes": self.host_peak_bytes,
            "offload_h2d_bytes": self.offload_h2d_bytes,
            "offload_d2h_bytes": self.offload_d2h_bytes,
            "foreach_temp_bytes": self.foreach_temp_bytes,
            "collectives": [list(c) for c in self.collectives],
            "attention_backends": dict(self.attention_backends),
            "autocast_ops": dict(self.autocast_ops),
            "reserved": None
            if self.reserved is None
            else {
                "max_reserved_bytes": self.reserved.max_reserved_bytes,
                "max_allocated_bytes": self.reserved.max_allocated_bytes,
                "fragmentation_bytes": self.reserved.fragmentation_bytes,
                "segments": self.reserved.segments,
                "streams": 1 + max(self.reserved_streams, default=0),
                "alloc_conf": self.reserved.alloc_conf,
            },
        }


@dataclass(frozen=True)
class ParallelMeasurement:
    """Per-rank peaks of one workload under one ``ParallelSpec``; ``worst`` is the largest."""

    spec: ParallelSpec
    ranks: tuple[RankMeasurement, ...]
    steady: bool = True
    plan_name: str = ""
    unseen: tuple[Unseen, ...] = field(default=())

    @property
    def worst(self) -> RankMeasurement:
        """The rank with the largest device peak (``peak_bytes`` unless CPU offload is on)."""
        return max(self.ranks, key=lambda r: (r.device_bytes, r.peak_bytes, -r.rank))

    @property
    def peak_bytes(self) -> int:
        """The worst rank's counted peak, host and device together (unseen lines not included)."""
        return self.worst.peak_bytes

    @property
    def device_peak_bytes(self) -> int:
        """The worst rank's device peak: what must fit on the GPU (``peak_bytes`` without offload)."""
        return self.worst.device_bytes

    @property
    def host_peak_bytes(self) -> int | None:
        """The largest host peak of any rank under CPU offload, else None."""
        hosts = [r.host_peak_bytes for r in self.ranks if r.host_peak_bytes is not None]
        return max(hosts) if hosts else None

    @property
    def unseen_low_bytes(self) -> int:
        return sum(u.low_bytes for u in self.unseen)

    @property
    def unseen_high_bytes(self) -> int:
        return sum(u.high_bytes for u in self.unseen)

    def rank(self, r: int) -> RankMeasurement:
        """The measurement that stands for rank ``r``."""
        for m in self.ranks:
            if r in m.ranks:
                return m
        raise KeyError(f"rank {r} was not measured")

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "steady": self.steady,
            "plan": self.plan_name,
            "ranks": [r.as_dict() for r in self.ranks],
            "worst_rank": self.worst.rank,
            "peak_bytes": self.peak_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "unseen": [
                {"name": u.name, "low_bytes": u.low_bytes, "high_bytes": u.high_bytes, "source": u.source}
                for u in self.unseen
            ],
        }

    def table(self) -> str:
        """A plain-text per-rank table with the unseen lines under it."""

        def fmt(n: int) -> str:
            return f"{n / GIB:9.2f} GiB" if n >= GIB else f"{n / MIB:9.1f} MiB"

        host_peak = self.host_peak_bytes
        offload = host_peak is not None
        head = f"{self.spec.describe()}{' (steady state)' if self.steady else ' (first step)'}"
        if offload:  # the split at the device peak; host memory in its own column

            def split(r: RankMeasurement) -> dict[str, int]:
                return r.device_peak_split or {}

            head += "; device = GPU memory, host = CPU memory (sharded parameters, gradients, optimizer)"
            first = "rank(s)        device peak   host peak     "
        else:

            def split(r: RankMeasurement) -> dict[str, int]:
                return r.peak_split

            first = (
                "rank(s)        peak          " if self.spec.pipeline_parallel == 1 else "rank (stage)   peak          "
            )
        cols = [c for c in CATEGORIES if any(split(r).get(c) for r in self.ranks)]
        replayed = all(r.reserved is not None for r in self.ranks)
        if replayed:  # the allocator replay's max_memory_reserved per rank, beside the counted peak
            first += "reserved      "
        lines = [head, first + "  ".join(f"{c:>14.14}" for c in cols)]
        pp = self.spec.pipeline_parallel
        for r in self.ranks:
            label = _ranks_label(r.ranks)
            if pp > 1:
                label = f"{_ranks_label(r.ranks)} (stage {','.join(map(str, stages_of(self.spec, r.rank)))})"
            host = f"{fmt(r.host_peak_bytes or 0)}  " if offload else ""
            reserved = f"{fmt(r.reserved.max_reserved_bytes)}  " if replayed and r.reserved is not None else ""
            lines.append(
                f"{label:<14} {fmt(r.device_bytes)}  {host}{reserved}"
                + "  ".join(f"{fmt(split(r).get(c, 0)):>14}" for c in cols)
            )
        where = " on the device" if offload else ""
        lines.append(f"worst rank {self.worst.rank}: {fmt(self.device_peak_bytes)} counted{where}")
        if replayed:
            top = max(self.ranks, key=lambda r: r.reserved.max_reserved_bytes if r.reserved else 0)
            assert top.reserved is not None
            lines.append(
                f"  predicted reserved (allocator replay, rank {top.rank}): {fmt(top.reserved.max_reserved_bytes).strip()}, "
                f"fragmentation at its allocated peak {fmt(top.reserved.fragmentation_bytes).strip()}"
            )
        for u in self.unseen:
            lines.append(f"  + {u.name}: {fmt(u.low_bytes).strip()} .. {fmt(u.high_bytes).strip()}  [{u.source}]")
        lines.append(
            f"worst rank with unseen lines: {fmt(self.device_peak_bytes + self.unseen_low_bytes).strip()} .. "
            f"{fmt(self.device_peak_bytes + self.unseen_high_bytes).strip()}{where}"
        )
        if host_peak is not None:
            lines.append(f"host memory per rank (worst): {fmt(host_peak).strip()}")
        return "\n".join(lines)


def _stages(spec: ParallelSpec) -> int:
    return 2 if spec.schedule == "interleaved_1f1b" else 1


def stages_of(spec: ParallelSpec, rank: int) -> tuple[int, ...]:
    """The pipeline stages ``rank`` holds: pipeline rank p holds stage p (interleaved: every pp-th
    stage from p); ranks are grouped TP x data-parallel per pipeline rank. () without stages."""
    pp = spec.pipeline_parallel
    if pp <= 1:
        return ()
    first = rank // (spec.world_size // pp)
    return tuple(range(first, pp * _stages(spec), pp))


def _ranks_label(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return f"{ranks[0]},..({len(ranks)})"
