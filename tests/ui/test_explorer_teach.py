"""Issue 42 in the explorer, without a browser: the header's host-memory label and the "Rule of
thumb" tab. Oracles: the engine's own measurement of the same plan (``Plan.apply`` + ``measure``),
``rule_of_thumb.teacher_view`` on the model as the plan applies it, and the bytes counted here from
the parameters (fp32: 4 B each; AdamW keeps two moments, SGD with momentum one buffer)."""

from __future__ import annotations

import html
import re

import pytest
import torch

from memsave_nb import zoo
from memsave_nb.measure import measure
from memsave_nb.measure.rule_of_thumb import teacher_view
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.planner.depth import blocks_of
from memsave_nb.ui.explorer import explore
from memsave_nb.ui.format import format_bytes
from memsave_nb.ui.styles import TEACH_CSS
from memsave_nb.ui.teach_table import phase_table, rule_table
from memsave_nb.zoo import GPTConfig

pytestmark = pytest.mark.timeout(300)

TINY_GPT = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def _rows(value: str) -> dict[str, list[str]]:
    """The cells of each ``data-part`` row of a tab table's HTML."""
    out = {}
    for part, body in re.findall(r"<tr data-part='([^']*)'>(.*?)</tr>", value):
        out[html.unescape(part)] = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", body)]
    return out


def _open(**kw):
    torch.manual_seed(0)
    wl = zoo.gpt(TINY_GPT, batch_size=2)
    return wl, explore(wl, live=False, repeats=0, **kw)


def test_one_block_offloaded_shows_the_engines_host_bytes_and_the_rule_beside_the_measured_split():
    wl, ex = _open()
    before = ModelSnapshot.capture(wl.model)
    assert ex.tabs.titles[6] == "Rule of thumb" and ex.tabs.children[6] is ex.teach.tab
    assert ex.host.layout.display == "none" and ex.host.value == ""  # nothing offloaded: no label
    style = [w for w in ex.children if "memsave-teach-style" in w._dom_classes]
    assert len(style) == 1 and style[0].value == TEACH_CSS and style[0].layout.display == "none"
    assert "var(--jp-content-font-color1" in TEACH_CSS and "@container (max-width: 760px)" in TEACH_CSS
    first = blocks_of(wl.model).names[0]
    ex.editor.set_region(first, "offload")
    entry = ex.run_now(raise_errors=True)
    assert entry is not None
    plan = Plan(regions={first: "offload"})
    with plan.apply(wl) as applied:
        m = measure(applied, mode="real", repeats=0)  # the engine, no explorer
        oracle = teacher_view(entry.measurement, applied.model, "adamw")
    host = entry.measurement.host
    assert host == m.host and host.to_host_bytes > 0
    assert host.peak_bytes == host.to_host_bytes == host.to_device_bytes  # all out in forward, all back
    assert ex.host.layout.display == ""
    assert ex.host.value == f"host {format_bytes(host.peak_bytes)}, {format_bytes(host.to_host_bytes)} moved/step"
    assert f"at most {host.peak_bytes:,} B at once" in ex.host.tooltip and "PCIe 5.0 x16" in ex.host.tooltip
    # the tab's view is rule_of_thumb's, and its rule is the bytes counted here
    view = ex.teach.view
    assert view == oracle
    params = {id(p): p for p in wl.model.parameters()}.values()  # tied weights once
    n = sum(p.numel() for p in params)
    assert [(p.part, p.params, p.rule_bytes) for p in view.parts] == [
        ("weights", n, 4 * n),
        ("gradients", n, 4 * n),
        ("optimizer state", n, 8 * n),
    ]
    rows = _rows(ex.teach.rule.value)
    assert list(rows) == ["weights", "gradients", "optimizer state", "total"]
    assert [rows[k] for k in rows] == rule_table(oracle)[1]
    assert [rows[k][2] for k in ("weights", "gradients", "optimizer state")] == ["4 B", "4 B", "8 B"]
    assert rows["total"][2] == "16 B"
    phases = _rows(ex.teach.phases.value)
    assert list(phases) == ["forward", "backward", "optimizer"]
    assert [phases[k] for k in phases] == phase_table(oracle)[1]
    assert f"leaves out {format_bytes(oracle.left_out_bytes)} at the peak" in ex.teach.notes.value
    assert oracle.left_out_bytes > 0 and oracle.peak_bytes == entry.measurement.peak_bytes
    # offload off again: the label goes; the model is as it was
    ex.editor.set_region(first, "none")
    ex.run_now(raise_errors=True)
    assert ex.host.layout.display == "none" and ex.host.value == ""
    assert before.differences(wl.model) == []


def test_switching_the_optimizer_and_freezing_change_the_rows_after_each_run():
    wl, ex = _open()
    state = _rows(ex.teach.rule.value)["optimizer state"]
    assert state[2] == "8 B" and state[5].startswith("8")  # AdamW: two fp32 moments (+ a step counter)
    ex.tuner.knob_optimizer.value = "sgd_momentum"
    ex.tuner.apply_knobs()
    assert ex.plan.optimizer == "sgd_momentum"
    ex.run_now(raise_errors=True)
    view = ex.teach.view
    n = view.trainable_params
    state = _rows(ex.teach.rule.value)["optimizer state"]
    assert view.optimizer == "sgd_momentum" and view.parts[2].rule_bytes == 4 * n
    assert view.parts[2].measured_bytes == 4 * n  # one momentum buffer, measured: no extra
    assert state[2] == "4 B" and state[5] == "4 B" and state[6] == "0 B"
    # freeze the first block: gradients and state count the trainable parameters only
    first = blocks_of(wl.model).names[0]
    frozen = sum(p.numel() for p in wl.model.get_submodule(first).parameters())
    ex.editor.set_frozen(first, True)
    ex.run_now(raise_errors=True)
    view = ex.teach.view
    assert view.trainable_params == n - frozen and view.total_params == n
    assert view.parts[1].rule_bytes == 4 * (n - frozen) and view.parts[2].rule_bytes == 4 * (n - frozen)
    assert _rows(ex.teach.rule.value)["total"][2] == "4 B + 8 B/trainable"


def test_fake_mode_shows_the_rule_too():
    wl, ex = _open(mode="fake")
    view = ex.teach.view
    assert view is not None and view.parts[0].measured_bytes == view.parts[0].rule_bytes
    assert _rows(ex.teach.rule.value)["weights"][2] == "4 B"
