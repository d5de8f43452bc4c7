"""Per-module and per-op attribution, the timeline, and FLOPs."""

from __future__ import annotations

from collections import Counter

from torch.utils.flop_counter import FlopCounterMode

from memsave_nb.measure import CATEGORIES
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.workload import iter_tensors

from .cases import CASES
from .conftest import measured
from .oracles import _step

CASE = {c.name: c for c in CASES}


def test_modules_in_named_modules_order_with_rollup(case):
    m = measured(case)
    model = case.build().model
    assert [r.name for r in m.modules] == [n for n, _ in model.named_modules()]
    own = {r.name: r.saved_bytes_own for r in m.modules}
    for row in m.modules:
        prefix = row.name + "."
        children = sum(b for n, b in own.items() if row.name == "" and n != "" or n.startswith(prefix))
        assert row.saved_bytes == row.saved_bytes_own + children, row.name
        assert row.depth == (0 if row.name == "" else row.name.count(".") + 1)
        assert row.is_leaf == (not any(True for _ in model.get_submodule(row.name).children()))
    assert m.module("").saved_bytes == m.saved_bytes == sum(own.values())
    assert m.saved_bytes == m.end_of_forward.activations


def test_params_per_module(case):
    m = measured(case)
    model = case.build().model
    for row in m.modules:
        own = list(model.get_submodule(row.name)._parameters.values())
        assert row.trainable_params == sum(p.numel() for p in own if p is not None and p.requires_grad)
        assert row.frozen_params == sum(p.numel() for p in own if p is not None and not p.requires_grad)


def test_ops_add_up(case):
    m = measured(case)
    assert sum(o.saved_bytes for o in m.ops) == m.saved_bytes
    assert sum(o.flops for o in m.ops) == m.flops
    assert sum(saved for _, _, _, saved in m.module_ops) == m.saved_bytes
    per_op = Counter()
    for _, op, calls, _ in m.module_ops:
        per_op[op] += calls
    assert {o.op: o.count for o in m.ops if o.count} == dict(+per_op)
    assert all(o.op.startswith("aten.") or o.op == "get_rng_state" for o in m.ops if o.saved_bytes)


def test_reused_module_counted_twice():
    m = measured(CASE["reused"])
    assert m.module("shared").calls == 2
    assert m.module("act").calls == 2
    assert m.module("head").calls == 1
    addmm = {op: calls for mod, op, calls, _ in m.module_ops if mod == "shared"}
    assert addmm["aten.addmm"] == 2
    # Tanh keeps its output, both times; the shared Linear keeps its inputs, which are inp's and
    # Tanh's outputs (counted there), so it owns nothing
    assert m.module("act").saved_bytes_own == 2 * 8 * 32 * 4
    assert m.module("inp").saved_bytes_own == 8 * 32 * 4
    assert m.module("shared").saved_bytes_own == 0


def test_sac_keeps_matmul_outputs_by_op():
    ops = {o.op: o.saved_bytes for o in measured(CASE["sac_matmuls"]).ops}
    full = {o.op: o.saved_bytes for o in measured(CASE["checkpointed"]).ops}
    assert ops["aten.addmm"] - full["aten.addmm"] == 8 * 64 * 4 + 8 * 32 * 4


def test_timeline_consistent(case):
    m = measured(case)
    tl = m.timeline
    n = len(tl)
    assert n > 0 and all(len(tl.by_category[c]) == n for c in CATEGORIES)
    total = tl.total()
    assert m.peak_bytes == max(total) == total[m.peak_index]
    assert all(total[i] < m.peak_bytes for i in range(m.peak_index))  # first time the peak is reached
    assert m.peak_split.as_dict() == {c: tl.by_category[c][m.peak_index] for c in CATEGORIES}
    assert m.peak_phase == tl.phase[m.peak_index]
    starts = tl.phase_starts
    expected = ["setup", "forward", "backward", "optimizer", "done"]
    present = [p for p in expected if p in starts]
    assert present == sorted(present, key=starts.__getitem__)
    assert {"forward", "backward"} <= set(starts)
    assert all(tl.phase[starts[p]] == p for p in starts)
    # the step ends as a training loop's step does: parameters, batch, targets, .grad and (steady
    # state: from the first event on) the optimizer's state remain
    final = {c: tl.by_category[c][-1] for c in CATEGORIES}
    assert final["activations"] == final["outputs"] == final["temporaries"] == 0
    assert m.steady_state
    assert (
        final["optimizer_state"] == tl.by_category["optimizer_state"][starts["forward"]] == m.peak_split.optimizer_state
    )
    assert final["parameters"] == m.peak_split.parameters
    wl = case.build()
    trainable = sum(p.numel() * p.element_size() for p in wl.model.parameters() if p.requires_grad)
    if wl.input_requires_grad:
        trainable += sum(t.numel() * t.element_size() for t in iter_tensors(wl.make_batch()) if t.is_floating_point())
    assert final["gradients"] == trainable
    assert all(v >= 0 for c in CATEGORIES for v in tl.by_category[c])


def test_flops_equal_flop_counter(case):
    wl = case.build()
    snapshot = ModelSnapshot.capture(wl.model)
    counter = FlopCounterMode(display=False)
    with counter:
        _step(wl)
    snapshot.restore(wl.model)
    expected = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    m = measured(case)
    assert m.flops == counter.get_total_flops()
    assert {o.op: o.flops for o in m.ops if o.flops} == {k: v for k, v in expected.items() if v}


def test_flops_off_changes_nothing_else():
    from memsave_nb.measure import measure

    case = CASE["zoo_gpt"]
    on, off = measured(case), measure(case.build(), repeats=0, flops=False)
    assert off.flops == 0 and on.flops > 0
    assert (off.peak_bytes, off.saved_bytes, off.timeline.total()) == (
        on.peak_bytes,
        on.saved_bytes,
        on.timeline.total(),
    )
