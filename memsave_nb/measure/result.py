"""Results of a measured step as frozen plain data: sizes, shapes, names. Never tensors.

Rendering (tables, Bokeh figures, HTML) lives elsewhere and reads these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

CATEGORIES = ("parameters", "inputs", "gradients", "optimizer_state", "activations", "outputs", "temporaries")
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class MemorySplit:
    """Live bytes by category at one moment (the peak, or the end of forward).

    ``activations``: what autograd keeps for backward; ``outputs``: what only the step's outputs
    keep alive (logits, KV cache, the loss) beyond that.
    """

    parameters: int = 0
    inputs: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    outputs: int = 0
    temporaries: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


@dataclass(frozen=True)
class ModuleStats:
    """One row of the per-layer table. ``saved_bytes`` is rolled up over the module's children.

    ``saved_bytes``: kept for backward by autograd; ``output_bytes``: kept alive to the end of
    forward only by the step's outputs (logits, KV cache), born in this module (``_own``) or its
    subtree.
    """

    name: str
    type_name: str
    depth: int
    output_shape: tuple[int, ...] | None
    trainable_params: int
    frozen_params: int
    saved_bytes_own: int
    saved_bytes: int
    calls: int
    is_leaf: bool
    output_bytes_own: int = 0
    output_bytes: int = 0
    # distinct parameters over the whole subtree: a weight tied between two modules of the subtree
    # (GPT-2's wte and lm_head) counted once; None where the producer did not count them
    trainable_params_subtree: int | None = None
    frozen_params_subtree: int | None = None

    @property
    def params(self) -> int:
        return self.trainable_params + self.frozen_params


def subtree_params(modules: "tuple[ModuleStats, ...] | list[ModuleStats]") -> dict[str, tuple[int, int]]:
    """(trainable, frozen) parameter counts per module over its whole subtree, each distinct
    parameter once. Rows without subtree counts fall back to adding up own counts (which counts a
    tied weight once per owner)."""
    out: dict[str, list[int]] = {m.name: [0, 0] for m in modules}
    for m in modules:
        if not (m.trainable_params or m.frozen_params):
            continue
        parts = m.name.split(".") if m.name else []
        for k in range(len(parts) + 1):
            key = ".".join(parts[:k])
            if key in out:
                out[key][0] += m.trainable_params
                out[key][1] += m.frozen_params
    for m in modules:
        if m.trainable_params_subtree is not None and m.frozen_params_subtree is not None:
            out[m.name] = [m.trainable_params_subtree, m.frozen_params_subtree]
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass(frozen=True)
class OpStats:
    """Per aten op type (overload packet, e.g. ``aten.mm``): forward calls, kept bytes, FLOPs."""

    op: str
    count: int
    saved_bytes: int
    flops: int


@dataclass(frozen=True)
class Timeline:
    """Live bytes per category after each allocation or free, in event order.

    ``phase[i]`` is the phase of event i; ``phase_starts`` maps a phase to its first event index.
    """

    phase: tuple[str, ...]
    by_category: dict[str, tuple[int, ...]]
    phase_starts: dict[str, int]

    def __len__(self) -> int:
        return len(self.phase)

    def total(self) -> tuple[int, ...]:
        cols = [self.by_category[c] for c in CATEGORIES]
        return tuple(sum(v) for v in zip(*cols)) if cols and cols[0] else ()


@dataclass(frozen=True)
class ReservedMemory:
    """What the caching-allocator model (measure/cuda_allocator.py) predicts for the step.

    ``max_reserved_bytes`` is ``torch.cuda.max_memory_reserved()``'s prediction;
    ``max_allocated_bytes`` is the peak of the allocator's rounded blocks; ``fragmentation_bytes``
    is reserved minus allocated when allocated peaks (cached but of no use to the peak), at
    timeline event ``peak_index``;
    ``reserved[i]`` is reserved bytes after timeline event i; ``alloc_conf`` the
    ``PYTORCH_CUDA_ALLOC_CONF`` it was replayed under.
    """

    max_reserved_bytes: int
    max_allocated_bytes: int
    fragmentation_bytes: int
    peak_index: int
    segments: int
    reserved: tuple[int, ...] = ()
    alloc_conf: str = ""
    # the replay's input, (key, bytes or 0 to free, event), so a target can replay it again under
    # its own capacity and settings (measure/reserved.py)
    ops: tuple[tuple[int, int, int], ...] = field(default=(), repr=False, compare=False)
    # an allocation below the dispatcher put into the replay (the cuBLAS workspace of a step sized
    # for CUDA, measure/cublas_workspace.py), and where its size comes from
    workspace_bytes: int = 0
    workspace_source: str = ""


@dataclass(frozen=True)
class HostMemory:
    """Host (CPU) memory the step holds for the device: the tensors offload regions copy out in
    forward and back in backward (``memsave_nb.offload``), counted per copy (a view saved twice is
    copied twice, as ``save_on_cpu`` does). All zero when nothing is offloaded.

    ``peak_bytes``: the most held at once; ``to_host_bytes`` / ``to_device_bytes``: moved each way
    in the step; ``tensors``: how many copies. Optimizer state and parameters are never host
    memory in a single-device step (no such choice exists there; FSDP2's CPU offload is per rank,
    ``memsave_nb.parallel``).
    """

    peak_bytes: int = 0
    to_host_bytes: int = 0
    to_device_bytes: int = 0
    tensors: int = 0


@dataclass(frozen=True)
class Measurement:
    """Everything one measured training step tells about memory and time.

    ``saved_bytes``: what autograd keeps for backward at the end of forward; ``output_bytes``:
    what the step's outputs and caches keep beyond that (``output_parts`` names them, e.g.
    ``("logits", n)``, ``("past_key_values", m)``); ``advice`` says what frees large ones.
    ``steady_state``: the measured step is training's step 2+ (optimizer state alive from the
    start); ``first_step_peak_bytes`` is the first step's peak (None when not measured).
    """

    mode: str
    device: str
    peak_bytes: int
    peak_split: MemorySplit
    peak_index: int
    peak_phase: str
    saved_bytes: int
    end_of_forward: MemorySplit
    modules: tuple[ModuleStats, ...]
    ops: tuple[OpStats, ...]
    module_ops: tuple[tuple[str, str, int, int], ...]  # (module, op, forward calls, saved bytes)
    timeline: Timeline
    step_seconds: float | None
    step_seconds_all: tuple[float, ...] = ()
    flops: int = 0
    cuda_peak_bytes: int | None = None
    cuda_baseline_bytes: int | None = None
    compiled: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    output_bytes: int = 0
    output_parts: tuple[tuple[str, int], ...] = ()
    first_step_peak_bytes: int | None = None
    steady_state: bool = False
    advice: tuple[str, ...] = ()
    # the allocator model's replay of the step (None where no replay ran)
    reserved: ReservedMemory | None = None
    # host memory held by offloaded activations (None where it was not counted: a compiled step)
    host: HostMemory | None = None

    # -- lookups -----------------------------------------------------------------------------
    def module(self, name: str) -> ModuleStats:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module named {name!r} in this measurement")

    def ops_in(self, prefix: str) -> tuple[OpStats, ...]:
        """Op types run in the forward of module ``prefix`` (and its children), with kept bytes.

        FLOPs here are not split per module; they are the op type's share of the whole step.
        """
        counts: dict[str, list[int]] = {}
        for module, op, calls, saved in self.module_ops:
            if prefix == "" or module == prefix or module.startswith(prefix + "."):
                row = counts.setdefault(op, [0, 0])
                row[0] += calls
                row[1] += saved
        flops = {o.op: o.flops for o in self.ops}
        return tuple(
            OpStats(op=op, count=c, saved_bytes=s, flops=flops.get(op, 0))
            for op, (c, s) in sorted(counts.items(), key=lambda kv: (-kv[1][1], kv[0]))
        )

    # -- tables ------------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Per-module rows as plain dicts (for tables, JSON, DataFrames)."""
        total = self.saved_bytes or 1
        out = []
        for m in self.modules:
            row = {f.name: getattr(m, f.name) for f in fields(m)}
            row["share"] = m.saved_bytes / total
            out.append(row)
        return out

    def to_dataframe(self):  # pragma: no cover - exercised when pandas is installed
        import pandas as pd

        return pd.DataFrame(self.rows())

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "peak_split": self.peak_split.as_dict(),
            "saved_bytes": self.saved_bytes,
            "output_bytes": self.output_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "steady_state": self.steady_state,
            "step_seconds": self.step_seconds,
            "flops": self.flops,
            "cuda_peak_bytes": self.cuda_peak_bytes,
            "host_peak_bytes": None if self.host is None else self.host.peak_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
