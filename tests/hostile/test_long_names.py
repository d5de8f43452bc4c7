"""A 10,000-character name at each door that echoed its value with ``!r`` (issue 38 follow-up): the
budget list, the device and fabric names, an op of a region policy, nested selective regions, a TP
plan's pattern and module, a plan's name fields. Each is refused in one line of at most 200
characters that quotes at most a short part of the name (``errors.quoted``), and the model is left
as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_nb import Plan, Workload
from memsave_nb.checkpointing import RegionPolicy
from memsave_nb.errors import MemsaveError
from memsave_nb.model_state import ModelSnapshot

LONG = "Z" * 10_000


def _refused(call) -> str:
    with pytest.raises(MemsaveError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and len(message) <= 200, message[:300]
    assert "Z" * 100 not in message  # a part of the name at most
    return message


def test_budget_list():
    from memsave_nb.ui.budget_panel import parse_budgets

    assert "is not a number" in _refused(lambda: parse_budgets(LONG))


def test_device_name():
    from memsave_nb.planner.roofline import device_named

    assert "choose one of" in _refused(lambda: device_named(LONG))


def test_fabric_name():
    from memsave_nb.planner.links import fabric_for

    assert "choose one of" in _refused(lambda: fabric_for(LONG))


def test_op_of_a_region_policy():
    message = _refused(lambda: RegionPolicy("selective", ops={f"aten.{LONG}": "save"}))
    assert "is not an operator" in message


class _Deep(nn.Module):
    """A block under a 10,000-character name, itself holding a child: two nested regions."""

    def __init__(self):
        super().__init__()
        outer = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.add_module(LONG, outer)

    def forward(self, x):
        return getattr(self, LONG)(x)


def test_nested_selective_regions():
    model = _Deep()
    before = ModelSnapshot.capture(model)
    policy = RegionPolicy("selective", ops={"aten.mm": "save"})

    def apply():
        with Plan(regions={LONG: policy, f"{LONG}.0": policy}).apply(Workload(model, torch.randn(2, 4))):
            pass

    assert "nested" in _refused(apply)
    assert before.differences(model) == []


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module(LONG, nn.ReLU())
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return getattr(self, LONG)(self.proj(x))


@pytest.mark.parametrize("pattern", [f"{LONG}*nothing", LONG])
def test_tp_plan_pattern_and_module(pattern):
    """A pattern that matches nothing, and a module named by it that is not a Linear."""
    from memsave_nb.parallel import ParallelSpec
    from memsave_nb.parallel.tp import resolve_tp_plan

    model = _Wide()
    before = ModelSnapshot.capture(model)

    def resolve():
        resolve_tp_plan(model, ParallelSpec(world_size=2, tensor_parallel=2, tp_plan=((pattern, "colwise"),)))

    message = _refused(resolve)
    assert ("no module matches" in message) if pattern != LONG else ("splits a Linear or Embedding" in message)
    assert before.differences(model) == []


def test_plan_name_fields():
    _refused(lambda: Plan(frozen={LONG: 1}))
    _refused(lambda: Plan(trainable=[LONG, 3]))
