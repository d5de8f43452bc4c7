"""The plan being edited: what the explorer's controls stand for, as plain state.

The widgets never build a :class:`~memsave_nb.plan.Plan` themselves: they call the editor
(``set_frozen``, ``set_memsave``, ``set_region``, ``set_op``...), and the editor turns its state
into a Plan (:meth:`PlanEditor.plan`) or loads one back (:meth:`PlanEditor.load`, used when a
point of the history is clicked). Listeners are told after every change.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from memsave_nb.checkpointing import POLICY_PRESETS, OpChoice, RegionKind, RegionPolicy, policy_preset
from memsave_nb.plan import Plan

from .tree import ModuleTree

#: label shown for each region choice, in menu order (keys of POLICY_PRESETS, plus "custom")
REGION_CHOICES: tuple[tuple[str, str], ...] = (
    ("no checkpoint", "none"),
    ("full checkpoint", "full"),
    ("save matmuls", "save_matmuls"),
    ("save compute-intensive", "save_compute_intensive"),
    ("recompute all", "recompute_all"),
    ("offload to host", "offload"),
    ("full checkpoint, inputs on host", "full_offload"),
    ("custom (per op)", "custom"),
)
CUSTOM = "custom"


def preset_key(policy: RegionPolicy | None) -> str:
    """The menu key of a region policy: a preset's name, or ``"custom"``."""
    if policy is None:
        return "none"
    for key, preset in POLICY_PRESETS.items():
        if preset == policy:
            return key
    return CUSTOM


def op_choice(policy: RegionPolicy | None, op: str) -> str:
    """Whether ``op``'s outputs are kept ("save") or recomputed ("recompute") under ``policy``."""
    if policy is None or policy.kind is RegionKind.NONE:
        return OpChoice.SAVE.value
    if policy.kind is RegionKind.FULL:
        return OpChoice.RECOMPUTE.value
    return policy.ops.get(op, policy.default).value


def _swappable_types() -> tuple[type, ...]:
    try:
        from memsave_nb.layers import MEMSAVE_LAYERS
    except ImportError:  # pragma: no cover - layers not installed
        return ()
    return tuple(MEMSAVE_LAYERS)


class PlanEditor:
    """Unit-level state of a plan for one model: frozen parameters, swapped layers, regions,
    input grad, batch-norm eval, compile budget."""

    def __init__(self, model: nn.Module, plan: Plan | None = None):
        self.tree = ModuleTree.from_model(model, _swappable_types())
        self.name = ""
        self.frozen_params: set[str] = {p for p, f in self.tree.initial_frozen.items() if f}
        self.swapped: set[str] = set()
        self.regions: dict[str, RegionPolicy] = {}
        self.input_requires_grad: bool | None = None
        self.bn_eval: tuple[str, ...] = ()
        self.compile_budget: float | None = None
        self._listeners: list[Callable[[], None]] = []
        if plan is not None:
            self.load(plan, notify=False)

    # -- listeners --------------------------------------------------------------------------
    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def _changed(self, *, keep_name: bool = False) -> None:
        if not keep_name:
            self.name = ""  # an edited plan is no longer the named one it was loaded from
        for fn in list(self._listeners):
            fn()

    # -- edits ------------------------------------------------------------------------------
    def set_frozen(self, module: str, frozen: bool) -> None:
        """Freeze (or unfreeze) every parameter below ``module``."""
        units = set(self.tree.params[module])
        new = self.frozen_params | units if frozen else self.frozen_params - units
        if new != self.frozen_params:
            self.frozen_params = new
            self._changed()

    def set_memsave(self, module: str, on: bool) -> None:
        """Swap (or keep) the memory-saving layers below ``module``."""
        units = set(self.tree.swappable[module])
        new = self.swapped | units if on else self.swapped - units
        if new != self.swapped:
            self.swapped = new
            self._changed()

    def set_region(self, module: str, choice: str | RegionPolicy) -> None:
        """Checkpoint ``module`` with a preset (``"full"``, ``"save_matmuls"``...), ``"none"``,
        ``"custom"`` (selective, every op kept until told otherwise) or a RegionPolicy."""
        if isinstance(choice, RegionPolicy):
            policy = choice
        elif choice == CUSTOM:
            current = self.regions.get(module)
            if current is not None and current.kind is RegionKind.SELECTIVE:
                return
            policy = RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.SAVE)
        else:
            policy = policy_preset(choice)
        new = dict(self.regions)
        if policy.kind is RegionKind.NONE:
            new.pop(module, None)
        else:
            new[module] = policy
        if new != self.regions:
            self.regions = new
            self._changed()

    def set_op(self, module: str, op: str, choice: str) -> None:
        """Keep (``"save"``) or recompute one op type inside region ``module``; a module that is
        not a region becomes a selective one that keeps everything else as eager would (or, from
        a full checkpoint, recomputes everything else)."""
        current = self.regions.get(module)
        ops: dict[str, OpChoice]
        if current is None or current.kind is RegionKind.NONE:
            ops, default = {}, OpChoice.SAVE
        elif current.kind is RegionKind.FULL:
            ops, default = {}, OpChoice.RECOMPUTE
        else:
            ops, default = dict(current.ops), current.default
        wanted = OpChoice(choice)
        if wanted == default:
            ops.pop(op, None)
        else:
            ops[op] = wanted
        if not ops and default is OpChoice.SAVE:
            policy = RegionPolicy(RegionKind.SELECTIVE, {}, OpChoice.SAVE)
        else:
            policy = RegionPolicy(RegionKind.SELECTIVE, ops, default)
        self.set_region(module, policy)

    def set_input_requires_grad(self, value: bool | None) -> None:
        if value != self.input_requires_grad:
            self.input_requires_grad = value
            self._changed()

    def set_bn_eval(self, on: bool) -> None:
        value = ("*",) if on else ()
        if value != self.bn_eval:
            self.bn_eval = value
            self._changed()

    def set_compile_budget(self, budget: float | None) -> None:
        if budget != self.compile_budget:
            self.compile_budget = budget
            self._changed()

    # -- views ------------------------------------------------------------------------------
    def frozen_boxes(self) -> dict[str, bool]:
        return self.tree.boxes(self.tree.params, self.frozen_params)

    def memsave_boxes(self) -> dict[str, bool]:
        return self.tree.boxes(self.tree.swappable, self.swapped)

    def region_key(self, module: str) -> str:
        return preset_key(self.regions.get(module))

    def plan(self) -> Plan:
        frozen, trainable = self.tree.freeze_fields(self.frozen_params)
        return Plan(
            name=self.name,
            frozen=tuple(frozen),
            trainable=tuple(trainable),
            input_requires_grad=self.input_requires_grad,
            bn_eval=self.bn_eval,
            memsave=tuple(self.tree.memsave_fields(self.swapped)),
            regions=dict(self.regions),
            compile_budget=self.compile_budget,
            **getattr(self, "knobs", {}),  # batch size, precision, ... kept from a loaded plan
        )

    def load(self, plan: Plan, *, notify: bool = True) -> None:
        """Take over every choice of ``plan`` (e.g. one clicked in the history)."""
        self.frozen_params = self.tree.frozen_from_plan(plan.frozen, plan.trainable)
        self.swapped = self.tree.swapped_from_plan(plan.memsave)
        self.regions = dict(plan.active_regions)
        self.input_requires_grad = plan.input_requires_grad
        self.bn_eval = tuple(plan.bn_eval)
        self.compile_budget = plan.compile_budget
        self.knobs = plan._knobs_dict()  # workload knobs the controls do not show (memsave_nb.knobs)
        self.name = plan.name
        if notify:
            self._changed(keep_name=True)
