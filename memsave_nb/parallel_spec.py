"""``ParallelSpec``: how the model is spread over ranks. Plain, comparable, JSON-ready data.

A plan holds one as its ``parallel`` field; it lives here, below the plan and ``parallel/``, so
the plan knows nothing of how ranks are measured or of ``fully_shard`` (``export/`` writes that).

FSDP2 (``fully_shard``) on a 1-D mesh of ``world_size`` ranks, or on a 2-D mesh
``(replicate, world_size // replicate)`` for HSDP; or DDP. With ``tensor_parallel`` > 1 the mesh
gains a last ``tp`` dimension (``parallelize_module``), FSDP2 shards over the rest (2-D).
Validated once, at construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from memsave_nb.checkpointing import show
from memsave_nb.errors import PlanError, WorkloadError
from memsave_nb.vocabulary import SCHEDULES as _SCHEDULES
from memsave_nb.vocabulary import STRATEGIES as _STRATEGIES

STRATEGIES = tuple(_STRATEGIES)
# Tensor-parallel styles a plan names (``parallel/tp.py`` maps each to PyTorch's ParallelStyle):
# colwise / rowwise Linear (or Embedding), the input embedding (rowwise, token ids replicated),
# the output head (colwise, logits gathered), a norm, a module that gathers its sequence-sharded
# input once and a learned position table split over positions (the last three for sequence parallel).
TP_STYLES = ("colwise", "rowwise", "embedding", "head", "norm", "gather_input", "gather_hidden_states", "positions")
DTYPES = ("float32", "bfloat16", "float16")
# torch.distributed.pipelining schedules (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)
SCHEDULES = tuple(_SCHEDULES)
MAX_MICROBATCHES = 1024
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
    - ``reshard_after_forward``: FSDP2 frees each unit's gathered parameters after forward
      (torch's default for a non-root module).
    - ``reshard_root``: the same for the root (what is not in a unit). ``False`` is torch's default
      for the root (``fully_shard``'s ``None``: keep it gathered, backward needs it first);
      accelerate's FSDP2 plugin (HF Trainer, TRL, axolotl) passes its ``reshard_after_forward`` to
      the root too, so configs imported from those set it.
    - ``param_dtype`` / ``reduce_dtype``: FSDP2 ``MixedPrecisionPolicy`` (``"bfloat16"``...).
    - ``cpu_offload``: FSDP2 ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer
      state live in host memory).
    - ``bucket_cap_mb``: DDP gradient bucket size.
    - ``gradient_as_bucket_view``: DDP's option: gradients are views of its buckets (one copy of
      the gradients instead of two).
    - ``tensor_parallel``: TP degree (ranks one layer's matrices are split over, within a node);
      the mesh is ``(replicate?, shard, tp)`` and FSDP2 shards over ``world_size // tp`` ranks.
    - ``sequence_parallel``: norms and the residual stream sharded over the sequence (TP > 1).
    - ``tp_plan``: ``(module-name pattern, style)`` pairs (``fnmatch`` patterns, styles in
      ``TP_STYLES``); empty means the default plan for decoders (``parallel/tp.py``).
    - ``pipeline_parallel``: pipeline stages (ranks the model's layers are split over); the mesh
      is ``(pp, replicate?, shard, tp?)``: each stage gets TP on ``tp`` and FSDP2 (HSDP) over the
      rest (``parallel/pipeline.py``); not with CPU offload or DDP.
    - ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"`` (two stages per rank).
    - ``microbatches``: micro-batches the batch is split into per step (pipeline only).
    """

    world_size: int = 8
    strategy: str = "fsdp"
    shard_modules: tuple[str, ...] = ()
    replicate: int = 1
    reshard_after_forward: bool = True
    reshard_root: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    tp_plan: tuple[tuple[str, str], ...] = ()
    pipeline_parallel: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1

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
        for f in ("reshard_after_forward", "reshard_root", "cpu_offload", "gradient_as_bucket_view"):
            if not isinstance(getattr(self, f), bool):
                raise ParallelError(f"{f} must be True or False, got {show(getattr(self, f))}")
        self._check_tensor_parallel()
        self._check_pipeline()
        b = self.bucket_cap_mb
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf"):
            raise ParallelError(f"bucket_cap_mb must be a positive number, got {show(b)}")
        set_(self, "bucket_cap_mb", float(b))

    def _check_tensor_parallel(self) -> None:
        tp, ws, r = self.tensor_parallel, self.world_size, self.replicate
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or (ws // r) % tp:
            raise ParallelError(
                f"tensor_parallel must be a positive divisor of world_size // replicate = {ws // r}, got {show(tp)}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ParallelError(f"sequence_parallel must be True or False, got {show(self.sequence_parallel)}")
        plan = self.tp_plan
        if isinstance(plan, Mapping):
            plan = tuple(plan.items())
        pair = lambda x: isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(v, str) for v in x)  # noqa: E731
        if isinstance(plan, str) or not isinstance(plan, (tuple, list)) or not all(map(pair, plan)):
            raise ParallelError(f"tp_plan must be (module-name pattern, style) pairs, got {show(self.tp_plan)}")
        plan = tuple((x[0], x[1]) for x in plan)  # pairs, checked above
        bad = [s for _, s in plan if s not in TP_STYLES]
        if bad:
            raise ParallelError(f"tp_plan style must be one of {TP_STYLES}, got {show(bad[0])}")
        object.__setattr__(self, "tp_plan", plan)
        if tp == 1 and (self.sequence_parallel or plan):
            raise ParallelError("sequence_parallel and tp_plan need tensor_parallel > 1")
        if tp > 1 and self.strategy != "fsdp":
            raise ParallelError("tensor_parallel is combined with FSDP2 (strategy 'fsdp'), not DDP")
        if tp > 1 and self.cpu_offload:
            raise ParallelError("cpu_offload with tensor_parallel is not measured yet")

    def _check_pipeline(self) -> None:
        pp, n = self.pipeline_parallel, self.microbatches
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or self.world_size % pp:
            raise ParallelError(
                f"pipeline_parallel must be a positive divisor of world_size {self.world_size}, got {show(pp)}"
            )
        if self.schedule not in SCHEDULES:
            raise ParallelError(f"schedule must be one of {SCHEDULES}, got {show(self.schedule)}")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_MICROBATCHES:
            raise ParallelError(f"microbatches must be an integer in [1, {MAX_MICROBATCHES}], got {show(n)}")
        if pp == 1:
            if n != 1 or self.schedule != "1f1b":
                raise ParallelError("schedule and microbatches need pipeline_parallel > 1")
            return
        if self.schedule == "interleaved_1f1b" and n % max(1, n // pp):
            raise ParallelError(
                f"interleaved_1f1b needs microbatches a multiple of max(1, microbatches // {pp}) "
                f"(torch's rounds), got {n}"
            )
        if self.cpu_offload or self.strategy != "fsdp":
            raise ParallelError(
                "pipeline_parallel is measured alone or with FSDP2, HSDP or TP: drop cpu_offload and strategy 'ddp'"
            )
        if (self.world_size // pp) % (self.replicate * self.tensor_parallel):
            raise ParallelError(
                f"pipeline_parallel {pp} x replicate {self.replicate} x tensor_parallel {self.tensor_parallel} "
                f"must divide world_size {self.world_size}"
            )

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        tp = (self.tensor_parallel,) if self.tensor_parallel > 1 else ()
        if self.pipeline_parallel > 1:  # (pp, replicate?, shard, tp?), as torchtitan's mesh
            rep = (self.replicate,) if self.replicate > 1 else ()
            return (
                self.pipeline_parallel,
                *rep,
                self.world_size // self.pipeline_parallel // self.replicate // self.tensor_parallel,
                *tp,
            )
        if self.replicate > 1:
            return (self.replicate, self.world_size // self.replicate // self.tensor_parallel, *tp)
        return (self.world_size // self.tensor_parallel, *tp)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        pp = ("pp",) if self.pipeline_parallel > 1 else ()
        return (
            pp
            + (("replicate",) if self.replicate > 1 else ())
            + ("shard",)
            + (("tp",) if self.tensor_parallel > 1 else ())
        )

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over (FSDP), 1 for DDP."""
        return (
            self.world_size // self.replicate // self.tensor_parallel // self.pipeline_parallel
            if self.strategy == "fsdp"
            else 1
        )

    @property
    def data_parallel(self) -> int:
        """Ranks the batch is split over (FSDP2 / HSDP / DDP); 1 under tensor parallel alone."""
        return self.world_size // self.tensor_parallel // self.pipeline_parallel

    @property
    def communicators(self) -> int:
        """Process groups (NCCL communicators) the strategy uses per rank."""
        dp = 2 if self.replicate > 1 else 1 if self.data_parallel > 1 else 0
        return dp + (1 if self.tensor_parallel > 1 else 0) + (1 if self.pipeline_parallel > 1 else 0)

    def describe(self) -> str:
        if self.pipeline_parallel > 1:
            name = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B"}[self.schedule]
            dp, tp = self.data_parallel, self.tensor_parallel
            return (
                f"PP {self.pipeline_parallel}"
                + (f" x TP {tp}" if tp > 1 else "")
                + (f" x {'HSDP' if self.replicate > 1 else 'FSDP2'} {dp}" if dp > 1 else "")
                + f" ({name}, {self.microbatches} micro-batches)"
            )
        if self.strategy == "ddp":
            view = ", gradients as bucket views" if self.gradient_as_bucket_view else ""
            return f"DDP x{self.world_size} (buckets {self.bucket_cap_mb:g} MB{view})"
        mesh = "x".join(map(str, self.mesh_shape))
        tp = self.tensor_parallel
        if tp > 1:
            dp_words = (
                ""
                if self.data_parallel == 1
                else f" x {'HSDP' if self.replicate > 1 else 'FSDP2'} {self.data_parallel}"
            )
            head = f"TP {tp}{dp_words} ({self.world_size} ranks, mesh {mesh}" + (
                ", sequence parallel)" if self.sequence_parallel else ")"
            )
        else:
            head = f"{'HSDP' if self.replicate > 1 else 'FSDP2'} x{self.world_size}" + (
                f" (mesh {mesh})" if self.replicate > 1 else ""
            )
        parts = [head]
        if not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.reshard_root:
            parts.append("root resharded after forward (accelerate's choice, not torch's default)")
        if self.param_dtype or self.reduce_dtype:
            parts.append(f"mixed precision {self.param_dtype or 'orig'}/{self.reduce_dtype or 'orig'}")
        if self.cpu_offload:
            parts.append("CPU offload")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shard_modules"] = list(self.shard_modules)
        d["tp_plan"] = [list(pair) for pair in self.tp_plan]
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
        if isinstance(kw.get("tp_plan"), list):
            kw["tp_plan"] = tuple(tuple(p) if isinstance(p, list) else p for p in kw["tp_plan"])
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
