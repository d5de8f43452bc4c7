"""One test per repro of issue 9 (each failed on main before the fix): wrong gradients under
memory-saving layers plus selective regions, restores that missed, code injection through
``to_code``, and bad plan input escaping as a traceback."""

from __future__ import annotations

import ast
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb.checkpointing import PlanError
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload


def _step(model: nn.Module, x: torch.Tensor, plan: Plan) -> dict[str, torch.Tensor]:
    wl = Workload(model, x, optimizer=None)
    with plan.apply(wl) as w:
        batch = w.make_batch()
        w.compute_loss(w.forward(batch)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if batch.grad is not None:
            grads["<input>"] = batch.grad.clone()
        for p in model.parameters():
            p.grad = None
    return grads


def _leaky_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


# -- 1. wrong gradients, no error -----------------------------------------------------------------
def test_memsave_with_a_save_default_selective_region_gives_stock_gradients():
    model, x = _leaky_mlp(), torch.randn(4, 8)
    common = dict(frozen=["0", "2"], input_requires_grad=True)
    sac = {"3": {"kind": "selective", "ops": {}, "default": "save"}}
    ref = _step(model, x, Plan(**common))
    got = _step(model, x, Plan(**common, memsave="*", regions=sac))
    assert set(got) == set(ref) == {"4.weight", "4.bias", "<input>"}
    for name in ref:  # was off by up to 5e-2
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6)


def test_memsave_with_selective_regions_beside_each_other_is_not_a_storage_error():
    """Was ``aten._to_copy.default encountered during backward but not found in storage``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.LeakyReLU(0.2),
        nn.Dropout(0.3),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 2),
    ).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    regions = {
        "4": "full",
        "5": {"kind": "selective", "ops": {}, "default": "save"},
        "2": {"kind": "selective", "ops": {"aten.addmm": "save"}, "default": "save"},
    }
    torch.manual_seed(1)
    ref = _step(model, x, Plan(trainable=["*.bias"]))
    torch.manual_seed(1)
    got = _step(model, x, Plan(trainable=["*.bias"], memsave="*", regions=regions))
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name])


def test_memsave_maxpool_in_a_save_default_region_gives_stock_gradients():
    """Was ``Tensor cached during selective activation checkpoint has been mutated`` in backward
    (the layer shifted its cached indices in place; fixed in the layers)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 2))
    x = torch.randn(2, 2, 4, 4)
    plan = Plan(memsave="*", regions={"1": {"kind": "selective", "ops": {}, "default": "save"}})
    ref = _step(model, x, Plan())
    got = _step(model, x, plan)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name])


def test_inplace_relu_after_a_region_that_saves_its_output_is_a_plan_error():
    """A region's cached output changed in place after the region: one PlanError line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    plan = Plan(regions={"1": {"kind": "selective", "ops": {}, "default": "save"}})
    with pytest.raises(PlanError, match="region '1'"):
        _step(model, torch.randn(3, 4), plan)


def test_nested_selective_regions_are_refused_at_construction():
    """Were ``aten.split.Tensor encountered during backward but not found in storage``."""
    with pytest.raises(PlanError, match="inside region ''"):
        Plan(regions={"": "full", "attn": "save_matmuls"})
    Plan(regions={"": "save_matmuls", "attn": "full"})  # full inside selective works


# -- 3. restores that miss ------------------------------------------------------------------------
def test_plan_apply_restores_batch_norm_statistics_changed_without_a_version_bump():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    before = ModelSnapshot.capture(model)
    with Plan().apply(Workload(model, torch.randn(5, 3))), torch.no_grad():
        model(torch.randn(5, 3))
    assert before.differences(model) == []


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1  # a new buffer object each call
        return self.lin(x)


class Reparam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = nn.Parameter(self.scale.detach() * 2)  # re-registered in forward
        return x * self.scale


@pytest.mark.parametrize("module", [Counter, Reparam], ids=["buffer", "parameter"])
def test_reassigned_buffers_and_parameters_are_put_back(module):
    model = module()
    objects = dict(model.named_buffers()) | dict(model.named_parameters())
    before = ModelSnapshot.capture(model)
    with Plan().apply(Workload(model, torch.randn(2, 3))):
        model(torch.randn(2, 3))
    assert before.differences(model) == []
    measure(Workload(model, torch.randn(2, 3), optimizer="sgd"), repeats=1, flops=False)
    assert before.differences(model) == []
    assert all(dict(model.named_buffers()).get(n, p) is p for n, p in objects.items())
    assert all(dict(model.named_parameters()).get(n, p) is p for n, p in objects.items())


def test_model_snapshot_restore_puts_reassigned_objects_back():
    model = Counter()
    count = model.count
    snap = ModelSnapshot.capture(model)
    model(torch.randn(2, 3))
    assert model.count is not count
    snap.restore(model)
    assert model.count is count and float(count) == 0.0
    assert snap.differences(model) == []


# -- 5. code execution from an untrusted plan -----------------------------------------------------
INJECTED = "\nPWNED.append(1)\n#"


def _run_snippet(code: str) -> list:
    ast.parse(code)
    pwned: list = []
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    exec(compile(code, "<plan>", "exec", dont_inherit=True), {"PWNED": pwned, "model": model})
    return pwned


@pytest.mark.parametrize("field", ["name", "frozen", "trainable", "bn_eval"])
def test_a_newline_in_a_name_runs_nothing(field):
    plan = Plan(**{field: "x" + INJECTED if field == "name" else ["x" + INJECTED]})
    assert _run_snippet(plan.to_code()) == []


def test_a_quote_and_newline_in_a_name_still_parse():
    plan = Plan(name="it's\n'''\"", frozen=["a'\"\n\\"])
    assert _run_snippet(plan.to_code()) == []


def test_a_selective_op_name_must_be_a_real_op():
    with pytest.raises(PlanError, match="aten.foo"):
        Plan(regions={"0": {"kind": "selective", "ops": {"aten.foo": "save"}}})
    with pytest.raises(PlanError):
        Plan(regions={"0": {"kind": "selective", "ops": {"aten.x" + INJECTED: "save"}}})
    with pytest.raises(PlanError):
        Plan.from_json(json.dumps({"regions": {"0": {"kind": "selective", "ops": {"foo.bar": "save"}}}}))


# -- 6. bad input that escaped as a traceback -----------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"compile_budget": ' + "9" * 5000 + "}",
        '{"regions": {"conv1": 5}}',
        '{"regions": {"conv1": null}}',
        "null",
        '{"frozen": {"conv1": 1}}',
        '{"regions": {"0": {"kind": "selective", "ops": {"foo.bar": "save"}}}}',
        '{"regions": {"0": {"kind": "selective", "ops": ["aten.mm"]}}}',
        '{"regions": []}',
        '{"name": 3}',
    ],
    ids=[
        "deep",
        "huge-number",
        "region-int",
        "region-null",
        "null",
        "frozen-dict",
        "unknown-op",
        "ops-list",
        "regions-list",
        "name-int",
    ],
)
def test_bad_plan_json_is_a_plan_error(text):
    with pytest.raises(PlanError) as info:
        Plan.from_json(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "field",
    [
        '"frozen": {}',
        '"name": {}',
        '"regions": {{"a": {}}}',
        '"regions": {{"a": {{"kind": {}}}}}',
        '"regions": {{"a": {{"ops": {}}}}}',
    ],
)
def test_deep_nesting_inside_a_field_is_a_plan_error(field):
    """Parsed by json, then too deep for repr() in an error message: still one PlanError line."""
    for depth in range(900, 1000, 3):
        with pytest.raises(PlanError):
            Plan.from_json("{" + field.format("[" * depth + "]" * depth) + "}")


@pytest.mark.parametrize("value", [None, b"{}", 3, ["{}"]])
def test_from_json_of_a_non_string_is_a_plan_error(value):
    with pytest.raises(PlanError):
        Plan.from_json(value)


def test_regions_given_as_a_string_is_a_plan_error():
    with pytest.raises(PlanError, match="regions"):
        Plan(regions="full")


@pytest.mark.parametrize("region", ["1", "seq"])
def test_a_region_around_an_inplace_activation_is_refused_at_apply(region):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.Linear(3, 1))
    model.add_module("seq", nn.Sequential(nn.ReLU(inplace=True)))
    model.seq.register_forward_hook(lambda *a: None)
    before = ModelSnapshot.capture(model)
    with pytest.raises(PlanError, match="inplace=True"):
        with Plan(regions={region: "full"}).apply(Workload(model, torch.randn(2, 3))):
            pass
    assert before.differences(model) == []


def test_a_region_writing_into_its_input_is_refused_at_its_first_forward():
    class AddOne(nn.Module):
        def forward(self, x):
            return x.add_(1)

    model = nn.Sequential(nn.Linear(3, 3), AddOne(), nn.Linear(3, 1))
    with pytest.raises(PlanError, match="region '1': AddOne.forward changes its input in place"):
        with Plan(regions={"1": "full"}).apply(Workload(model, torch.randn(2, 3))) as w:
            F.mse_loss(w.forward(w.make_batch()), torch.zeros(2, 1)).backward()
