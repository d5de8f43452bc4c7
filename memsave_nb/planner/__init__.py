"""The planner: plans that fit a target GPU, ranked by estimated step time (search.py); layouts over N GPUs (layout.py)."""

from memsave_nb.planner.cost import StepCost, step_cost
from memsave_nb.planner.layout import LayoutCandidate, LayoutResult, check_layout_args, plan_layout
from memsave_nb.planner.pareto import pareto_front
from memsave_nb.planner.roofline import GPUS, Device, calibrate_host, device_named
from memsave_nb.planner.search import REGION_KINDS, Candidate, PlannerResult, plan_for
from memsave_nb.planner.what_fits import KnobHint, hint_lines, what_would_fit

__all__ = [
    "GPUS",
    "Device",
    "calibrate_host",
    "device_named",
    "StepCost",
    "step_cost",
    "pareto_front",
    "REGION_KINDS",
    "Candidate",
    "PlannerResult",
    "plan_for",
    "LayoutCandidate",
    "LayoutResult",
    "check_layout_args",
    "plan_layout",
    "KnobHint",
    "hint_lines",
    "what_would_fit",
]
