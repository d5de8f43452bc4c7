"""The layout search's numbers about the model itself: sizes read off the parameters (no step run)
and the fake-mode measurements, each made once per key and extrapolated from two shallow depths
(``depth.py``): per-rank peaks (``measure_parallel`` / ``measure_pipeline``), the blocks'
single-device saved activations (for the lower bound) and the roofline seconds (``cost.step_cost``).

The measured numbers live in a ``Measured`` store. A search makes its own by default; the layout
planner hands each search the store kept for the same model and start (``layout_cache.py``), so a
second search (another GPU kind, target or GPU count) reuses every key it shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import Blocks, extrapolate
from memsave_nb.planner.layout_specs import REGION_KINDS
from memsave_nb.planner.pp import measured_stages
from memsave_nb.planner.roofline import Device
from memsave_nb.planner.start_plan import StartPlan

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.workload import Workload

__all__ = ["Measured", "RankSizes"]


@dataclass
class Measured:
    """Measured numbers by key; ``measurements`` counts the per-rank shallow runs made into it."""

    rank: dict = field(default_factory=dict)  # (spec, kind, precision, mb, k) -> worst rank's peak and split
    cost: dict = field(default_factory=dict)  # (precision, mb, device) -> roofline seconds per phase
    saved: dict = field(default_factory=dict)  # (kind, precision) -> the blocks' saved bytes at micro-batch 1
    root: dict = field(default_factory=dict)  # shard_modules -> bytes of the root's own parameters
    full: dict = field(default_factory=dict)  # (spec, plan as JSON) -> the full-depth re-measurement
    measurements: int = 0


@dataclass
class RankSizes:
    workload: "Workload"
    blocks: Blocks
    device: Device
    start: StartPlan = field(default_factory=lambda: StartPlan(Plan(), REGION_KINDS, (None,), None, ""))
    store: Measured = field(default_factory=Measured)
    measurements: int = 0  # per-rank shallow runs this search made (a reused key costs none)

    # -- sizes, no step run --------------------------------------------------------------------
    def param_bytes(self, precision: str | None = None) -> tuple[int, int]:
        """Parameter bytes, all and trainable; under the bf16 precisions floating ones at 2 bytes."""
        model, plan = self.workload.model, self.start.plan
        named = list(model.named_parameters())
        trains = set(plan.trainable_parameter_names(model)) if plan.frozen or plan.trainable else None

        def size(p) -> int:
            low = precision in ("bf16", "bf16_master") and p.is_floating_point()
            return p.numel() * (min(2, p.element_size()) if low else p.element_size())

        return (
            sum(size(p) for _, p in named),
            sum(size(p) for n, p in named if (n in trains if trains is not None else p.requires_grad)),
        )

    def root_bytes(self, spec: ParallelSpec) -> int:
        """Bytes of the parameters in no FSDP2 unit (the root's), which torch's default does not
        gather again in backward; 0 under pipeline stages (each stage is its own root)."""
        if spec.pipeline_parallel > 1 or spec.strategy != "fsdp":
            return 0
        key = spec.shard_modules
        if key not in self.store.root:
            from memsave_nb.parallel.apply import shard_units

            model = self.workload.model
            inside = {id(p) for n in shard_units(model, spec) for p in model.get_submodule(n).parameters()}
            self.store.root[key] = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
        return self.store.root[key]

    def hidden_and_vocab(self) -> tuple[int, int]:
        """The block's width (the first linear's input) and the head's outputs (the last linear's)."""
        import torch.nn as nn

        first = self.workload.model.get_submodule(self.blocks.names[0]) if self.blocks.names else self.workload.model
        hidden = next((m.in_features for m in first.modules() if isinstance(m, nn.Linear)), 0)
        vocab = next(
            (m.out_features for m in reversed(list(self.workload.model.modules())) if isinstance(m, nn.Linear)), 0
        )
        return hidden, vocab

    def seq_len(self) -> int:
        from memsave_nb.knobs import seq_len_of
        from memsave_nb.target import _raw_batch

        try:
            return self.start.plan.seq_len or seq_len_of(_raw_batch(self.workload)) or 1
        except Exception:  # noqa: BLE001 - a batch without tokens: one position
            return 1

    def act_bytes(self) -> int:
        p = next(self.workload.model.parameters(), None)
        return p.element_size() if p is not None else 4

    # -- measurements, each key once -----------------------------------------------------------
    def plan_for(
        self,
        names: Sequence[str],
        kind: str | None,
        precision: str | None,
        mb: int,
        k: int = 1,
        spec: ParallelSpec | None = None,
    ) -> Plan:
        """The start plan with one candidate's choices: ``kind`` on the blocks ``names``."""
        return self.start.with_choices({n: kind for n in names} if kind else {}, precision, mb, k, spec)

    def saved_per_block(self, kind: str | None, precision: str | None) -> float:
        """Single-device saved activations of all blocks at micro-batch 1 (for the lower bound)."""
        key = (kind, precision)
        if key not in self.store.saved:
            from memsave_nb.target import measure_peak

            def run(model, names):
                plan = self.plan_for(names, kind, precision, 1)
                m = measure_peak(self.workload.replace(model=model), plan, "fake")
                return {"saved": float(sum(m.module(n).saved_bytes for n in names))}

            self.store.saved[key] = extrapolate(self.workload.model, self.blocks, run)["saved"]
        return self.store.saved[key]

    def rank_split(
        self, spec: ParallelSpec, kind: str | None, precision: str | None, mb: int = 1, k: int = 1
    ) -> dict[str, float]:
        """The worst rank's device peak (key "peak") and split, at full depth."""
        key = (spec, kind, precision, mb, k)
        if key not in self.store.rank:
            from memsave_nb.parallel import measure_parallel, measure_pipeline

            pp = spec.pipeline_parallel  # PP: the schedule's micro-batches, each of ``mb``, from mb x m per rank

            def run(model, names):
                wl = self.workload.replace(model=model)
                if pp > 1:
                    plan = self.plan_for(names, kind, precision, mb * spec.microbatches)
                    # shallow twins: as below, no allocator replay (it would be no rank's)
                    m = measure_pipeline(wl, spec, plan, ranks=measured_stages(spec), replay=False)
                else:
                    # shallow twins extrapolated over depth: their allocator replay would be no rank's
                    m = measure_parallel(wl, spec, self.plan_for(names, kind, precision, mb, k), replay=False)
                self.measurements += 1
                self.store.measurements += 1
                w = m.worst
                split = w.device_peak_split if w.device_peak_split is not None else w.peak_split
                counted = {f"coll:{op}:{n}": float(b) for op, n, _, b in getattr(w, "collectives", ())}
                # pipeline stages: every rank's peak per micro-batch phase, each extrapolated on its own
                segments = {f"segment:{r.rank}:{label}": float(b) for r in m.ranks for label, b in r.segment_peaks}
                return {
                    "peak": float(m.device_peak_bytes),
                    **{c: float(v) for c, v in split.items()},
                    **counted,
                    **segments,
                }

            out = extrapolate(self.workload.model, self.blocks, run, stages=pp)
            out["peak"] = max([out["peak"], *(v for k, v in out.items() if k.startswith("segment:"))])
            self.store.rank[key] = out
        return self.store.rank[key]

    def cost(self, kind: str | None, precision: str | None, mb: int) -> dict[str, float]:
        """Single-device roofline seconds per phase at micro-batch ``mb`` and the recomputation
        ``kind`` adds (one fake pass per precision and micro-batch serves every kind)."""
        key = (precision, mb, self.device)
        if key not in self.store.cost:
            from memsave_nb.planner.cost import step_cost

            def run(model, names):
                c = step_cost(
                    self.workload.replace(model=model), self.plan_for(names, None, precision, mb), names, self.device
                )
                out = dict(c.seconds)
                for k in REGION_KINDS[1:]:
                    out[f"recompute {k}"] = sum(c.recompute_seconds(n, k) for n in names)
                return out

            self.store.cost[key] = extrapolate(self.workload.model, self.blocks, run)
        out = dict(self.store.cost[key])
        out["recompute"] = out.get(f"recompute {kind}", 0.0) if kind else 0.0
        return out
