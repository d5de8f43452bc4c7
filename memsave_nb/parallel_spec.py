"""``ParallelSpec``: how the model is spread over ranks. Plain, comparable, JSON-ready data.

A plan holds one as its ``parallel`` field; it lives here, below the plan and ``parallel/``, so
the plan knows nothing of how ranks are measured or of ``fully_shard`` (``export/`` writes that).

FSDP2 (``fully_shard``) on a 1-D mesh of ``world_size`` ranks, or on a 2-D mesh
``(replicate, world_size // replicate)`` for HSDP; or DDP. Validated once, at construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from memsave_nb.checkpointing import show
from memsave_nb.errors import PlanError, WorkloadError

STRATEGIES = ("fsdp", "ddp")
DTYPES = ("float32", "bfloat16", "float16")
MAX_WORLD_SIZE = 1 << 16


class ParallelError(WorkloadError):
    """A parallel choice that cannot be applied (bad world size, unknown module, busy process group)."""


@dataclass(frozen=True)
class ParallelSpec:
    """Per-rank sizing choices.

    - ``world_size``: number of ranks (GPUs).
    - ``strategy``: ``"fsdp"`` (FSDP2 ``fully_shard``) or ``"ddp"`` (``DistributedDataParallel``).
    - ``shard_modules``: FSDP units, exact module names; the root is always one more unit.
      Empty means the repeated blocks (``checkpointing.suggest_regions``), as one would choose.
    - ``replicate``: HSDP replica groups; the mesh is ``(replicate, world_size // replicate)``.
    - ``reshard_after_forward``: FSDP2 frees the gathered parameters after forward.
    - ``param_dtype`` / ``reduce_dtype``: FSDP2 ``MixedPrecisionPolicy`` (``"bfloat16"``...).
    - ``cpu_offload``: FSDP2 ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer
      state live in host memory).
    - ``bucket_cap_mb``: DDP gradient bucket size.
    - ``gradient_as_bucket_view``: DDP's option: gradients are views of its buckets (one copy of
      the gradients instead of two).
    """

    world_size: int = 8
    strategy: str = "fsdp"
    shard_modules: tuple[str, ...] = ()
    replicate: int = 1
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or not 1 <= ws <= MAX_WORLD_SIZE:
            raise ParallelError(f"world_size must be an integer in [1, {MAX_WORLD_SIZE}], got {show(ws)}")
        if self.strategy not in STRATEGIES:
            raise ParallelError(f"strategy must be one of {STRATEGIES}, got {show(self.strategy)}")
        names = self.shard_modules
        if isinstance(names, str):
            names = (names,)
        if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) for n in names):
            raise ParallelError(f"shard_modules must be module names, got {show(self.shard_modules)}")
        set_(self, "shard_modules", tuple(dict.fromkeys(names)))
        r = self.replicate
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or ws % r:
            raise ParallelError(f"replicate must be a positive divisor of world_size {ws}, got {show(r)}")
        if r > 1 and self.strategy != "fsdp":
            raise ParallelError("replicate (HSDP) needs strategy 'fsdp'")
        if self.cpu_offload is True and self.strategy != "fsdp":
            raise ParallelError("cpu_offload is FSDP2's CPUOffloadPolicy: it needs strategy 'fsdp'")
        for f in ("param_dtype", "reduce_dtype"):
            v = getattr(self, f)
            if v is not None and v not in DTYPES:
                raise ParallelError(f"{f} must be one of {DTYPES} or None, got {show(v)}")
        for f in ("reshard_after_forward", "cpu_offload", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, f), bool):
                raise ParallelError(f"{f} must be True or False, got {show(getattr(self, f))}")
        b = self.bucket_cap_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf"):
            raise ParallelError(f"bucket_cap_mb must be a positive number, got {show(b)}")
        set_(self, "bucket_cap_mb", float(b))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.replicate > 1:
            return (self.replicate, self.world_size // self.replicate)
        return (self.world_size,)

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over (FSDP), 1 for DDP."""
        return self.world_size // self.replicate if self.strategy == "fsdp" else 1

    @property
    def communicators(self) -> int:
        """Process groups (NCCL communicators) the strategy uses per rank."""
        return 2 if self.replicate > 1 else 1

    def describe(self) -> str:
        if self.strategy == "ddp":
            view = ", gradients as bucket views" if self.gradient_as_bucket_view else ""
            return f"DDP x{self.world_size} (buckets {self.bucket_cap_mb:g} MB{view})"
        mesh = "x".join(map(str, self.mesh_shape))
        parts = [f"{'HSDP' if self.replicate > 1 else 'FSDP2'} x{self.world_size}" + (f" (mesh {mesh})" if self.replicate > 1 else "")]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.param_dtype or self.reduce_dtype:
            parts.append(f"mixed precision {self.param_dtype or 'orig'}/{self.reduce_dtype or 'orig'}")
        if self.cpu_offload:
            parts.append("CPU offload")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shard_modules"] = list(self.shard_modules)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ParallelSpec":
        if not isinstance(data, Mapping):
            raise ParallelError(f"parallel must be an object, got {show(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ParallelError(f"unknown parallel field(s): {show(', '.join(map(str, unknown)))}")
        kw = dict(data)
        if "shard_modules" in kw and isinstance(kw["shard_modules"], list):
            kw["shard_modules"] = tuple(kw["shard_modules"])
        return cls(**kw)


def parallel_field(value: Any) -> ParallelSpec:
    """``Plan.parallel``: a ``ParallelSpec``, or its JSON object; bad values are a one-line ``PlanError``."""
    try:
        if isinstance(value, ParallelSpec):
            return value
        if isinstance(value, Mapping):
            return ParallelSpec.from_dict(value)
    except (ParallelError, TypeError) as exc:
        raise PlanError(f"plan field 'parallel': {exc}") from None
    raise PlanError(f"plan field 'parallel' must be a ParallelSpec, an object or None, got {show(value)}")
