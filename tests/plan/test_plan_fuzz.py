"""Plan files from strangers (issue 9, sections 5 and 6), fuzzed with hypothesis.

Every input to ``Plan.from_json`` -- arbitrary JSON, plan-shaped objects with hostile names,
raw text, non-strings -- gives a Plan or a one-line PlanError, nothing else. For every accepted
plan, ``to_code()`` parses and runs nothing but the plan. Three checks, each able to catch an
``os.system`` smuggled in through a name:

1. the snippet's syntax tree equals that of a twin plan whose names are replaced by plain
   placeholders, once string literals are blanked: a name can only ever be a string literal;
2. every identifier in the snippet comes from the snippet's own vocabulary (no ``os``,
   ``system``, ``__import__``, ``exec``, ...);
3. the snippet is executed on a real small model with ``os.system`` patched to record calls and a
   ``PWNED`` list that the payloads append to: both stay empty.
"""

from __future__ import annotations

import ast
import builtins
import json
import os

import pytest
import torch
import torch._functorch.config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from memsave_nb.checkpointing import COMPUTE_INTENSIVE_OPS, POLICY_PRESETS, PlanError
from memsave_nb.plan import Plan, _is_pattern

FUZZ = settings(
    max_examples=1100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

PAYLOADS = [
    "\nPWNED.append(1)\n#",
    "'\nPWNED.append(1)\n'",
    '"\nPWNED.append(1)\n"',
    "'''\nPWNED.append(1)\n'''",
    '"""\nPWNED.append(1)\n"""',
    "\r__import__('os').system('true')\r#",
    "\r\n__import__('os').system('true')\n#",
    "\\\nPWNED.append(1)",
    "\u2028PWNED.append(1)",
    "\x0c\nPWNED.append(1)",
    "\x00",
    "'); __import__('os').system('true'); ('",
    "#",
    "{}",
    "*",
    "",
    "blocks.0",
    "é\u200b\U0001f600",
]
hostile = st.one_of(
    st.sampled_from(PAYLOADS),
    st.text(max_size=12),
    st.builds(lambda a, b, c: a + b + c, st.text(max_size=4), st.sampled_from(PAYLOADS), st.text(max_size=4)),
)
OP_NAMES = list(COMPUTE_INTENSIVE_OPS) + [
    "aten.gelu",
    "aten.relu",
    "foo.bar",
    "aten.mm.default",
    "aten.__class__",
    "aten.mm\nPWNED.append(1)",
    "torch.ops",
]
ops = st.one_of(st.sampled_from(OP_NAMES), hostile)
policy = st.one_of(
    st.sampled_from(sorted(POLICY_PRESETS) + ["Save-Matmuls", "nope"]),
    hostile,
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["selective", "full", "none", "bad"])},
        optional={
            "ops": st.dictionaries(ops, st.sampled_from(["save", "recompute", "keep"]), max_size=4),
            "default": st.sampled_from(["save", "recompute", 1]),
        },
    ),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | hostile,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(hostile, children, max_size=3),
    max_leaves=12,
)
names = st.one_of(st.lists(hostile, max_size=3), hostile, json_values)
plan_objects = st.fixed_dictionaries(
    {},
    optional={
        "version": st.sampled_from([1, 1, 2, "1", True]),
        "name": st.one_of(hostile, json_values),
        "frozen": names,
        "trainable": names,
        "bn_eval": names,
        "memsave": names,
        "input_requires_grad": st.sampled_from([None, True, False, 1, "yes"]),
        "regions": st.one_of(st.dictionaries(hostile, policy, max_size=3), json_values),
        "compile_budget": st.one_of(st.none(), st.floats(allow_nan=True), st.integers(), hostile),
    },
)
# well-formed plans whose names (and only names) are hostile: the injection surface
good_policy = st.one_of(
    st.sampled_from(sorted(POLICY_PRESETS)),
    st.fixed_dictionaries(
        {
            "kind": st.just("selective"),
            "ops": st.dictionaries(st.sampled_from(OP_NAMES[:-5]), st.sampled_from(["save", "recompute"]), max_size=3),
            "default": st.sampled_from(["save", "recompute"]),
        }
    ),
)
well_formed = st.fixed_dictionaries(
    {},
    optional={
        "name": hostile,
        "frozen": st.lists(hostile, max_size=3),
        "trainable": st.lists(hostile, max_size=3),
        "bn_eval": st.lists(hostile, max_size=2),
        "memsave": st.lists(hostile, max_size=2),
        "input_requires_grad": st.sampled_from([None, True, False]),
        "regions": st.dictionaries(hostile.filter(lambda n: not _is_pattern(n)), good_policy, max_size=2),
        "compile_budget": st.one_of(st.none(), st.floats(0, 1)),
    },
)
texts = st.one_of(
    well_formed.map(json.dumps),
    well_formed.map(json.dumps),
    well_formed.map(json.dumps),
    well_formed.map(json.dumps),
    well_formed.map(json.dumps),
    plan_objects.map(json.dumps),
    plan_objects.map(json.dumps),
    plan_objects.map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=40),
    st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 50_000).map(lambda n: '{"regions": ' * n),
    st.integers(300, 6000).map(lambda n: '{"compile_budget": ' + "7" * n + "}"),
    st.integers(1, 1200).map(lambda n: '{"regions": {"a": {"kind": ' + "[" * n + "]" * n + "}}}"),
)
inputs = st.one_of(texts, texts, texts, st.none(), st.binary(max_size=8), st.integers(), st.lists(st.text(max_size=3)))


# -- the three checks ---------------------------------------------------------------------------------
def _twin(plan: Plan) -> Plan:
    """The same plan with every name replaced by a plain placeholder of the same shape."""
    counter = iter(range(10**6))

    def plain(name: str) -> str:
        if name in ("", "*"):
            return name
        return f"n{next(counter)}" + ("*" if _is_pattern(name) else "")

    return Plan(
        name="plan" if plan.name else "",
        frozen=[plain(n) for n in plan.frozen],
        trainable=[plain(n) for n in plan.trainable],
        bn_eval=[plain(n) for n in plan.bn_eval],
        memsave=[plain(n) for n in plan.memsave],
        regions={(k if k == "" else f"r{next(counter)}"): v for k, v in plan.regions.items()},
        input_requires_grad=plan.input_requires_grad,
        compile_budget=plan.compile_budget,
    )


def _shape(code: str) -> str:
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = "S"
    return ast.dump(tree)


def _identifiers(code: str) -> tuple[set[str], set[str]]:
    """(names, attributes) the snippet uses: every identifier it defines, reads or calls."""
    names, attrs = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            attrs.add(node.attr)
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return names, attrs


_OWN = _identifiers(
    Plan(
        name="v",
        frozen=["a"],
        trainable=["b"],
        bn_eval=["c"],
        memsave=["d"],
        input_requires_grad=True,
        regions={"e": "full", "f": "save_matmuls", "g": {"kind": "selective", "default": "save"}},
        compile_budget=0.5,
    ).to_code()
)
_ONE = _identifiers(Plan(regions={"f": "save_matmuls"}).to_code())  # one policy: policy_fn, POLICY_FN_SAVE
# the workload knobs' code (memsave_nb.knobs): every precision and optimizer the plan format accepts
_KNOBS = [
    _identifiers(
        Plan(
            batch_size=2,
            seq_len=4,
            precision=precision,
            optimizer=optimizer,
            accumulation_steps=2,
            set_to_none=False,
            regions={"e": "offload"},
        ).to_code()
    )
    for precision in ("fp32", "autocast_bf16", "autocast_fp16", "bf16", "bf16_master")
    for optimizer in ("adamw", "adamw_foreach", "adamw_fused", "sgd_momentum", "sgd", "adafactor")
]
VOCABULARY = _OWN[0] | _OWN[1] | _ONE[0] | _ONE[1] | set().union(*(a | b for a, b in _KNOBS))
FORBIDDEN_NAMES = {
    "os",
    "__import__",
    "exec",
    "eval",
    "open",
    "compile",
    "subprocess",
    "PWNED",
    "breakpoint",
    "globals",
}
FORBIDDEN_ATTRS = {"system", "popen", "Popen", "remove", "rmtree"}
assert not _OWN[0] & FORBIDDEN_NAMES and not _OWN[1] & FORBIDDEN_ATTRS


def _forbidden(code: str) -> set[str]:
    names, attrs = _identifiers(code)
    return (names & FORBIDDEN_NAMES) | (attrs & FORBIDDEN_ATTRS) | ((names | attrs) - VOCABULARY)


class AnyNameModel(nn.Sequential):
    """A real small model that answers ``get_submodule`` for any name (regions name hostile
    modules), so the snippet can run to its end."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.ReLU())

    def get_submodule(self, target: str) -> nn.Module:
        return self[0]


def _run(code: str) -> tuple[list, list]:
    pwned: list = []
    calls: list = []
    system, budget = os.system, torch._functorch.config.activation_memory_budget
    os.system = lambda *a, **k: calls.append(a) or 0
    try:
        namespace = {"model": AnyNameModel(), "PWNED": pwned, "__builtins__": builtins}
        exec(compile(code, "<plan>", "exec", dont_inherit=True), namespace)
    finally:
        os.system = system
        torch._functorch.config.activation_memory_budget = budget
    return pwned, calls


@pytest.mark.slow
@FUZZ
@given(text=inputs)
def test_from_json_gives_a_plan_or_a_plan_error_and_its_code_runs_only_the_plan(text):
    try:
        plan = Plan.from_json(text)
    except PlanError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 400, repr(str(exc))
        event("refused")
        return
    event("accepted" + (" with regions" if plan.regions else ""))
    assert Plan.from_json(plan.to_json()) == plan  # what was accepted round-trips
    code = plan.to_code()
    assert _shape(code) == _shape(_twin(plan).to_code())  # 1. names only as string literals
    assert _forbidden(code) == set()  # 2. its own vocabulary only
    assert _run(code) == ([], [])  # 3. executed: no payload ran


def test_the_checks_catch_an_injection():
    """The checks above are not vacuous: a snippet with a payload spliced in fails each of them."""
    plan = Plan(name="x", frozen=["a"])
    code = plan.to_code()
    evil = code.replace(
        "# memsave_nb plan: x", "# memsave_nb plan: x\n__import__('os').system('true'); PWNED.append(1)\n#"
    )
    assert _shape(evil) != _shape(_twin(plan).to_code())
    assert _forbidden(evil) == {"__import__", "system", "PWNED", "append"}
    assert _run(evil) == ([1], [("true",)])
