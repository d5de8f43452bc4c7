"""A Plan: the memory choices for one workload, as plain data, applied and undone exactly.

Choices are keyed by names from ``named_modules()`` / ``named_parameters()``:

- ``frozen`` / ``trainable``: names whose parameters get ``requires_grad=False`` / ``True``
  (``frozen`` first, then ``trainable``, so ``trainable`` overrides). A module name selects every
  parameter below it; ``"*"`` (or the root, ``""``) selects all; fnmatch patterns are accepted
  (``"*.bias"``). A plan with neither leaves the model's own flags alone.
- ``input_requires_grad``: whether the batch's floating tensors require grad (``None``: the
  workload's own setting).
- ``bn_eval``: modules whose batch-norm layers (themselves or below them) run in eval mode.
- ``memsave``: modules to swap for the memory-saving layers (``"*"``: all), via
  :func:`memsave_nb.layers.convert`.
- ``regions``: ``{module name: RegionPolicy}``, see :mod:`memsave_nb.checkpointing`.
- ``compile_budget``: ``None`` (eager) or a ``torch.compile`` activation memory budget in [0, 1].

``Plan.apply(workload)`` is a context manager that makes these choices and yields the workload to
measure; on exit, by error or not, the model is as it was (see :class:`RestorePoint`).
``Plan.to_code()`` writes the same choices as a standalone snippet; ``to_json``/``from_json``
save and load (never pickle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from memsave_nb.workload import DEFAULT_LOOP
from memsave_nb.checkpointing import (
    PlanError,
    RegionKind,
    RegionPolicy,
    check_nesting,
    show,
    wrap_region,
)
from memsave_nb.naming import ALL, _is_pattern, _names, memsave_include, selects  # noqa: F401 - selects, memsave_include: public here too
from memsave_nb.restore import RestorePoint

if TYPE_CHECKING:  # pragma: no cover
    from memsave_nb.workload import Workload

__all__ = ["Plan", "PlanError", "RegionPolicy", "RestorePoint", "selects", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1


def _norm_types() -> tuple[type[nn.Module], ...]:
    return (nn.modules.batchnorm._BatchNorm,)


@dataclass(frozen=True)
class Plan:
    """Memory choices for one workload. Plain, comparable, JSON-serialisable data."""

    name: str = ""
    frozen: tuple[str, ...] = ()
    trainable: tuple[str, ...] = ()
    input_requires_grad: bool | None = None
    bn_eval: tuple[str, ...] = ()
    memsave: tuple[str, ...] = ()
    regions: Mapping[str, RegionPolicy] = field(default_factory=dict)
    compile_budget: float | None = None
    # workload knobs (memsave_nb.knobs): None keeps the workload's own setting
    batch_size: int | None = None
    seq_len: int | None = None
    precision: str | None = None
    optimizer: str | None = None
    accumulation_steps: int | None = None
    set_to_none: bool | None = None
    loss: str | None = None  # "full" | "chunked" (memsave_nb.loss)
    loss_chunk: int | None = None  # tokens per chunk of the chunked loss (None: loss.DEFAULT_LOSS_CHUNK)

    parallel: Any = None  # memsave_nb.parallel.ParallelSpec | None: per-rank sizing (measure_parallel)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        from memsave_nb.knobs import check_knobs

        for knob, value in check_knobs(self).items():
            set_(self, knob, value)
        if self.parallel is not None:
            from memsave_nb.parallel_spec import parallel_field

            set_(self, "parallel", parallel_field(self.parallel))
        if not isinstance(self.name, str):
            raise PlanError(f"plan name must be a string, got {show(self.name)}")
        for f in ("frozen", "trainable", "bn_eval", "memsave"):
            set_(self, f, _names(getattr(self, f), f))
        if self.input_requires_grad is not None and not isinstance(self.input_requires_grad, bool):
            raise PlanError(f"input_requires_grad must be True, False or None, got {show(self.input_requires_grad)}")
        if self.regions is not None and not isinstance(self.regions, Mapping):
            raise PlanError(f"plan field 'regions' must map module names to policies, got {show(self.regions)}")
        regions: dict[str, RegionPolicy] = {}
        for module_name, policy in dict(self.regions or {}).items():
            if not isinstance(module_name, str):
                raise PlanError(f"region name {show(module_name)} is not a module name")
            if _is_pattern(module_name):
                raise PlanError(f"region {show(module_name)}: name one module, not a pattern")
            if not isinstance(policy, (str, Mapping, RegionPolicy)):
                raise PlanError(f"region {show(module_name)}: {show(policy)} is not a region policy")
            regions[module_name] = policy if isinstance(policy, RegionPolicy) else RegionPolicy.from_dict(policy)
        check_nesting(regions)
        set_(self, "regions", regions)
        budget = self.compile_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)):
                raise PlanError(f"compile_budget must be a number in [0, 1] or None, got {show(budget)}")
            if not (0 <= budget <= 1):  # before float(): a huge int would overflow; NaN fails too
                raise PlanError(f"compile_budget must lie in [0, 1], got {show(budget)}")
            budget = float(budget)
            set_(self, "compile_budget", budget)

    def __hash__(self) -> int:
        return hash(self.to_json())

    # -- views -------------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        """True when applying the plan changes nothing (the baseline)."""
        return (
            not self.frozen
            and not self.trainable
            and self.input_requires_grad is None
            and not self.bn_eval
            and not self.memsave
            and not self.active_regions
            and self.compile_budget is None
            and not self.has_knobs
            and self.parallel is None
        )

    @property
    def has_knobs(self) -> bool:
        """True when a workload knob (batch size, precision, optimizer, ...) is set."""
        from memsave_nb.knobs import KNOB_FIELDS

        return any(getattr(self, f) is not None for f in KNOB_FIELDS)

    @property
    def active_regions(self) -> dict[str, RegionPolicy]:
        return {k: v for k, v in self.regions.items() if v.kind is not RegionKind.NONE}

    @property
    def compiled(self) -> bool:
        return self.compile_budget is not None

    def describe(self, model: nn.Module | None = None) -> str:
        """One line a human reads: what the plan changes. Given the model, it also says when the
        plan turns the model's KV cache off (regions on a model with ``config.use_cache`` on)."""
        parts = []
        if self.frozen:
            parts.append(f"freeze {_short(self.frozen)}")
        if self.trainable:
            parts.append(f"train {_short(self.trainable)}")
        if self.input_requires_grad is not None:
            parts.append(f"input grad {'on' if self.input_requires_grad else 'off'}")
        if self.bn_eval:
            parts.append(f"BN eval {_short(self.bn_eval)}")
        if self.memsave:
            parts.append(f"memsave {_short(self.memsave)}")
        regions = self.active_regions
        if regions:
            kinds = sorted({_policy_label(p) for p in regions.values()})
            verb = "offload" if kinds == ["offload"] else ("checkpoint/offload" if "offload" in kinds else "checkpoint")
            parts.append(f"{verb} {len(regions)} region{'s' * (len(regions) != 1)} ({', '.join(kinds)})")
            if model is not None:
                from memsave_nb.hf import has_kv_cache

                if has_kv_cache(model):
                    parts.append("KV cache off (use_cache=False)")
        if self.compile_budget is not None:
            parts.append(f"compile budget {self.compile_budget:g}")
        from memsave_nb.knobs import describe_knobs

        parts += describe_knobs(self)
        if self.parallel is not None:
            parts.append(self.parallel.describe())
        return "; ".join(parts) or "baseline (no changes)"

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_FORMAT_VERSION,
            "name": self.name,
            "frozen": list(self.frozen),
            "trainable": list(self.trainable),
            "input_requires_grad": self.input_requires_grad,
            "bn_eval": list(self.bn_eval),
            "memsave": list(self.memsave),
            "regions": {k: v.to_dict() for k, v in self.regions.items()},
            "compile_budget": self.compile_budget,
            **self._knobs_dict(),
            **({"parallel": self.parallel.to_dict()} if self.parallel is not None else {}),
        }

    def _knobs_dict(self) -> dict[str, Any]:
        from memsave_nb.knobs import KNOB_FIELDS

        return {f: getattr(self, f) for f in KNOB_FIELDS if getattr(self, f) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("version", PLAN_FORMAT_VERSION)
        if type(version) is not int or version != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format version {show(version)} is not supported (expected {PLAN_FORMAT_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"plan: unknown fields {show(sorted(map(str, unknown)))}")
        regions = data.pop("regions", None)
        if regions is not None and not isinstance(regions, Mapping):
            raise PlanError("plan field 'regions' must be an object {module name: policy}")
        return cls(**data, regions=regions or {})

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from :meth:`to_json`'s text. Anything else -- not a string, not JSON, too deep,
        a number too long, a field of the wrong type, an unknown op -- is a :class:`PlanError`."""
        if not isinstance(text, str):
            raise PlanError(f"plan JSON must be a string, got {type(text).__name__}")
        try:
            data = json.loads(text)
        except RecursionError:
            raise PlanError("plan JSON is nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, or an integer beyond Python's digit limit
            raise PlanError(f"plan JSON does not parse: {show(str(exc), 100)[1:-1]}") from None
        return cls.from_dict(data)

    # -- validation --------------------------------------------------------------------------
    def validate(self, model: nn.Module) -> None:
        """Raise :class:`PlanError` naming the first name this model does not have."""
        module_names = [n for n, _ in model.named_modules(remove_duplicate=False)]
        param_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        module_set = set(module_names)
        for field_name in ("frozen", "trainable"):
            for pattern in getattr(self, field_name):
                if pattern in (ALL, ""):
                    continue
                if pattern in module_set or pattern in param_names:
                    continue
                if _is_pattern(pattern) and (
                    any(fnmatch.fnmatchcase(n, pattern) for n in param_names)
                    or any(fnmatch.fnmatchcase(n, pattern) for n in module_names)
                ):
                    continue
                raise PlanError(
                    f"plan {field_name}: {pattern!r} names no parameter or module of {type(model).__name__}"
                )
        for field_name in ("bn_eval", "memsave"):
            for pattern in getattr(self, field_name):
                if pattern in (ALL, "") or pattern in module_set:
                    continue
                if _is_pattern(pattern) and any(fnmatch.fnmatchcase(n, pattern) for n in module_names):
                    continue
                raise PlanError(f"plan {field_name}: {pattern!r} names no module of {type(model).__name__}")
        for region in self.regions:
            if region not in module_set:
                raise PlanError(f"plan region {region!r} names no module of {type(model).__name__}")

    # -- apply -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def apply(self, workload: "Workload", *, copy_parameters: bool = False) -> Iterator["Workload"]:
        """Make the choices on ``workload.model``; yield the workload to measure; undo on exit.

        The yielded workload is ``workload`` itself when nothing but the model changes, else a
        ``dataclasses.replace`` copy (``input_requires_grad``, the compiled model).
        On exit -- normal, by exception, or by a step that raised -- parameters and buffers hold
        their bits, ``requires_grad`` flags and ``.grad`` objects, module objects and classes,
        instance ``forward`` attributes, train/eval modes and hooks are as they were.
        Parameter values are not copied (the measuring engine undoes its own optimizer step);
        pass ``copy_parameters=True`` when the body may write into parameters itself.
        A compiled plan resets torch.compile's caches on entry and exit (``torch._dynamo.reset()``):
        each budget compiles afresh.
        """
        model = workload.model
        self.validate(model)
        snapshot = RestorePoint(model, copy_parameters=copy_parameters)
        undo: list[Any] = []  # callables, run in reverse order
        try:
            # 1. swap memory-saving layers (first: regions and flags apply to the new modules)
            if self.memsave:
                from memsave_nb.layers import convert, revert

                conversion = convert(model, include=memsave_include(self.memsave))
                undo.append(lambda conversion=conversion: revert(conversion))
            # 2. freezing
            self._apply_flags(model)
            # 3. batch norm in eval mode
            self._apply_bn_eval(model)
            # 4. checkpointed regions (Hugging Face's KV cache off for the step: they do not mix)
            if self.active_regions:
                from memsave_nb.hf import cache_off

                undo.append(cache_off(model, workload.batch))
            for region, policy in self.active_regions.items():
                undo.append(wrap_region(model.get_submodule(region), policy, region))
            # 5. what the step sees
            changes: dict[str, Any] = {}
            if self.has_knobs:  # batch, sequence, precision, optimizer, accumulation (knobs.py)
                from memsave_nb.knobs import apply_knobs

                knob_changes, knob_undo = apply_knobs(self, workload)
                undo.extend(knob_undo)
                changes.update(knob_changes)
            if self.input_requires_grad is not None and self.input_requires_grad != workload.input_requires_grad:
                changes["input_requires_grad"] = self.input_requires_grad
            if self.compile_budget is not None:
                import torch._functorch.config as functorch_config

                torch._dynamo.reset()
                undo.append(torch._dynamo.reset)
                patch = functorch_config.patch(activation_memory_budget=self.compile_budget)
                patch.__enter__()
                undo.append(lambda patch=patch: patch.__exit__(None, None, None))
                changes["model"] = torch.compile(model)
            yield dataclasses.replace(workload, **changes) if changes else workload
        finally:
            errors: list[BaseException] = []
            for fn in reversed(undo):
                try:
                    fn()
                except BaseException as exc:  # keep undoing; report after
                    errors.append(exc)
            try:
                snapshot.restore()
            except BaseException as exc:
                errors.append(exc)
            if errors:
                # never hide the step's own exception; raise ours only on a clean exit
                import sys

                if sys.exc_info()[1] is None:
                    raise errors[0]
                warnings.warn(f"while undoing plan {self.name or self.describe()!r}: {errors[0]!r}", stacklevel=2)

    def _apply_flags(self, model: nn.Module) -> None:
        if not self.frozen and not self.trainable:
            return
        for name, param in model.named_parameters(remove_duplicate=False):
            if selects(name, self.frozen):
                param.requires_grad_(False)
        for name, param in model.named_parameters(remove_duplicate=False):
            if selects(name, self.trainable):
                param.requires_grad_(True)

    def _apply_bn_eval(self, model: nn.Module) -> None:
        if not self.bn_eval:
            return
        for name, module in model.named_modules():
            if isinstance(module, _norm_types()) and selects(name, self.bn_eval):
                module.eval()

    def trainable_parameter_names(self, model: nn.Module) -> list[str]:
        """Names of the parameters that require grad under this plan (without applying it).

        A tied parameter (one object under several names) is listed once, by its
        ``named_parameters()`` name; it trains when ``trainable`` selects any of its names, and is
        frozen when ``frozen`` selects any of them and ``trainable`` none (see :mod:`memsave_nb.hf`)."""
        from memsave_nb.hf import parameter_names, resolve_flag

        params = dict(model.named_parameters())
        return [
            name
            for name, names in parameter_names(model).items()
            if resolve_flag(names, params[name].requires_grad, self.frozen, self.trainable)
        ]

    # -- code export -------------------------------------------------------------------------
    def to_code(self, model_var: str = "model", loop: str = DEFAULT_LOOP) -> str:
        """A standalone snippet that makes this plan's choices on ``model_var`` in a training
        script. Run it once, after building the model and before the training loop (and
        before building the optimizer, which should take the trainable parameters only).
        It ends with ``training_step``: the step as the engine measured it, with the workload's
        ``loop`` (pass ``workload.loop``; the default is the workload's default)."""
        from memsave_nb.export.pytorch import plan_code

        return plan_code(self, model_var, loop)


def _short(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(n if n else "<root>" for n in names[:limit])
    return shown + (f" +{len(names) - limit}" if len(names) > limit else "")


def _policy_label(policy: RegionPolicy) -> str:
    from memsave_nb.checkpointing import POLICY_PRESETS

    for name, preset in POLICY_PRESETS.items():
        if preset == policy:
            return name
    return "selective"
