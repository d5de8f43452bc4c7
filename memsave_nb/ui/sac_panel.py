"""Selective activation checkpointing for the selected region: one row per op type.

For the module selected in the layer table the panel lists each op type run in its forward with
its count, the bytes it kept in the baseline (eager) and under the current plan, its FLOPs, and a
save/recompute toggle; the region presets sit on top. Edits go to the :class:`PlanEditor`.

Before any run the panel says which ops SAC cannot keep and why (an output a later op changes in
place, found by :mod:`memsave_nb.ui.sac_check`): their toggles are greyed out with the reason. When
two presets are the same on this region (no matmuls in a CNN block) it says so and names the preset
that keeps something.

DOM hooks: ``.memsave-sac`` (the panel), ``.memsave-sac-title``, ``.memsave-sac-presets``,
``.memsave-sac-op-<op slug>`` (one toggle per op, ``aten.mm`` -> ``aten-mm``),
``.memsave-sac-advice`` (the notes on this region), ``.memsave-sac-cost`` (why the plan on display
keeps more or less than eager: ``ui/sac_cost.py``).
"""

from __future__ import annotations

import html
import threading
from typing import Callable

import ipywidgets as W

from memsave_nb.measure import Measurement
from memsave_nb.measure.tracker import RNG_STATE_OP

from .editor import REGION_CHOICES, PlanEditor, op_choice
from .format import format_bytes, format_count
from .sac_cost import sac_cost_lines
from .sac_check import preset_advice
from .tree import slug

_COLS = (("op", 220), ("count", 60), ("kept (baseline)", 120), ("kept (now)", 110), ("FLOPs (op, step)", 130))
_TOGGLE_PX = 2 * 96 + 16  # the save / recompute buttons and their margins

#: the op list is one sideways scroller holding its header and its rows (issue 42: at 700 px each
#: row squeezed on its own and the header above no longer named the columns); the op name stays put.
SAC_CSS = """<style>
.memsave-sac-table { overflow-x: auto; overflow-y: hidden; max-width: 100%; }
.memsave-sac-table .memsave-sac-rows, .memsave-sac-table .memsave-sac-row,
.memsave-sac-table .memsave-sac-head { min-width: max-content; overflow: visible; flex-wrap: nowrap; }
.memsave-sac-table .memsave-sac-head { border-bottom: 1px solid rgba(128,128,128,0.5); }
.memsave-sac-table .memsave-sac-opcell { position: sticky; left: 0; z-index: 1; background: var(--jp-layout-color1, #fff); }
</style>"""


def _cell(text: str, width: int, align: str = "left", cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return (
        f'<span{c} style="display:inline-block;width:{width}px;text-align:{align};overflow:hidden;'
        f'white-space:nowrap;text-overflow:ellipsis">{text}</span>'
    )


_INFO_PX = sum(w for _, w in _COLS) + 8  # the HTML widget's own padding


class _OpRow:
    def __init__(self, panel: "SacPanel", op: str):
        self.op = op
        self.info = W.HTML(layout=W.Layout(width=f"{_INFO_PX}px", flex="0 0 auto"))
        self.toggle = W.ToggleButtons(
            options=[("save", "save"), ("recompute", "recompute")],
            value="save",
            style={"button_width": "96px"},
            layout=W.Layout(width=f"{_TOGGLE_PX}px", flex="0 0 auto"),
            tooltips=["keep this op's outputs for backward", "recompute them in backward"],
        )
        self.toggle.add_class("memsave-sac-op")
        self.toggle.add_class(f"memsave-sac-op-{slug(op)}")
        self.box = W.HBox([self.info, self.toggle], layout=W.Layout(align_items="center"))
        self.box.add_class("memsave-sac-row")
        self.toggle.observe(lambda ch: panel._user_op(op, ch["new"]), "value")


class SacPanel(W.VBox):
    """``unsavable(region) -> {op: reason}`` tells which ops SAC cannot keep in a region (None: not
    checked, e.g. in fake mode)."""

    def __init__(self, editor: PlanEditor, unsavable: Callable[[str], dict[str, str] | None] | None = None):
        self.editor = editor
        self.unsavable = unsavable
        self.blocked: dict[str, str] = {}
        # the worker thread (a result) and the kernel thread (a selection) both rebuild: one at a
        # time, or one's "syncing" flag ends while the other still sets toggles
        self._lock = threading.RLock()
        self.module: str | None = None
        self._rows: dict[str, _OpRow] = {}
        self._syncing = False
        self._baseline: Measurement | None = None
        self._measurement: Measurement | None = None
        self._plan = None  # the plan of the measurement on display (what the cost lines explain)
        self.title = W.HTML(
            "<i>Select a module in the layer table (click its name) to tune its checkpointing per op.</i>"
        )
        self.title.add_class("memsave-sac-title")
        self.presets = W.ToggleButtons(options=list(REGION_CHOICES), value="none", style={"button_width": "150px"})
        self.presets.add_class("memsave-sac-presets")
        self.presets.observe(self._user_preset, "value")
        self.header = W.HBox(
            [
                W.HTML(
                    "".join(
                        _cell(f"<b>{h}</b>", w, cls="memsave-sac-opcell" if i == 0 else "")
                        for i, (h, w) in enumerate(_COLS)
                    ),
                    layout=W.Layout(width=f"{_INFO_PX}px", flex="0 0 auto"),
                ),
                W.HTML("<b>save or recompute</b>", layout=W.Layout(width=f"{_TOGGLE_PX}px", flex="0 0 auto")),
            ]
        )
        self.header.add_class("memsave-sac-head")
        self.ops_box = W.VBox()
        self.ops_box.add_class("memsave-sac-rows")
        self.table = W.VBox([W.HTML(SAC_CSS, layout=W.Layout(display="none")), self.header, self.ops_box])
        self.table.add_class("memsave-sac-table")
        self.advice = W.HTML("")
        self.advice.add_class("memsave-sac-advice")
        self.cost = W.HTML("")
        self.cost.add_class("memsave-sac-cost")
        self.note = W.HTML(
            "<small>Save keeps an op's outputs for backward; recompute runs the op again in backward. "
            "FLOPs are the op type's total over the whole step (not split per module).</small>"
        )
        super().__init__([self.title, self.presets, self.advice, self.table, self.cost, self.note])
        self.add_class("memsave-sac")
        self._set_enabled(False)

    def _set_enabled(self, on: bool) -> None:
        self.presets.disabled = not on
        for op, r in self._rows.items():
            r.toggle.disabled = not on or op in self.blocked

    # -- what to show ----------------------------------------------------------------------
    def show_module(self, module: str) -> None:
        self.module = module
        self._rebuild()

    def show(self, measurement: Measurement, baseline: Measurement, plan=None) -> None:
        self._measurement, self._baseline, self._plan = measurement, baseline, plan
        self._rebuild()

    def op_names(self) -> list[str]:
        if self.module is None or self._baseline is None:
            return []
        return [o.op for o in self._region_ops(self._baseline)]

    def _region_ops(self, measurement: Measurement) -> list:
        """The region's ops a policy can name: checkpoint's stashed generator state is no torch op."""
        assert self.module is not None  # its callers return first when no region is shown
        return [o for o in measurement.ops_in(self.module) if o.op != RNG_STATE_OP]

    def _rebuild(self) -> None:
        with self._lock:
            self._rebuild_locked()

    def _rebuild_locked(self) -> None:
        if self.module is None or self._baseline is None:
            return
        name = self.module or "(model)"
        key = self.editor.region_key(self.module)
        label = dict((v, k) for k, v in REGION_CHOICES).get(key, key)
        self.title.value = f"<b>Region <code>{html.escape(name)}</code></b>: {html.escape(label)}"
        base_ops = self._region_ops(self._baseline)
        now = {o.op: o for o in self._region_ops(self._measurement or self._baseline)}
        rows = []
        policy = self.editor.regions.get(self.module)
        try:
            blocked = self.unsavable(self.module) if self.unsavable is not None else None
        except Exception as exc:  # noqa: BLE001 - advice only: say it could not be checked
            blocked, unchecked = None, f"(could not check which ops can be kept: {type(exc).__name__}: {exc})"
        else:
            unchecked = (
                ""
                if blocked is not None or self.unsavable is None
                else "(which ops SAC can keep is checked in real mode only)"
            )
        self.blocked = dict(blocked or {})
        notes = []
        for op, reason in self.blocked.items():
            notes.append(f"<li><code>{html.escape(op)}</code> cannot be saved: {html.escape(reason)}.</li>")
        advice = preset_advice([o.op for o in base_ops])
        if advice:
            notes.append(f"<li>{html.escape(advice)}</li>")
        if unchecked:
            notes.append(f"<li>{html.escape(unchecked)}</li>")
        self.advice.value = (
            f"<ul style='margin:2px 0;font-size:90%;color:#8a6d3b'>{''.join(notes)}</ul>" if notes else ""
        )
        self._syncing = True
        try:
            if self.presets.value != key:
                self.presets.value = key
            for o in base_ops:
                r = self._rows.get(o.op)
                if r is None:
                    r = self._rows[o.op] = _OpRow(self, o.op)
                cur = now.get(o.op)
                why = self.blocked.get(o.op)
                op_text = f"<code>{html.escape(o.op)}</code>" + (
                    " <small style='color:#8a6d3b'>(cannot be saved)</small>" if why else ""
                )
                r.info.value = "".join(
                    [
                        _cell(op_text, _COLS[0][1], cls="memsave-sac-opcell"),
                        _cell(format_count(o.count), _COLS[1][1], "right"),
                        _cell(format_bytes(o.saved_bytes), _COLS[2][1], "right"),
                        _cell(format_bytes(cur.saved_bytes if cur else 0), _COLS[3][1], "right"),
                        _cell(f"{o.flops:.3g}" if o.flops else "-", _COLS[4][1], "right"),
                    ]
                )
                choice = op_choice(policy, o.op)
                if r.toggle.value != choice:
                    r.toggle.value = choice
                r.toggle.tooltips = (
                    (["cannot be saved: " + why] * 2)
                    if why
                    else ["keep this op's outputs for backward", "recompute them in backward"]
                )
                rows.append(r.box)
        finally:
            self._syncing = False
        self.ops_box.children = tuple(rows)
        self._show_cost(base_ops)
        self._set_enabled(True)

    def _show_cost(self, base_ops: list) -> None:
        """Why the plan on display keeps more (or less) than eager here, in measured bytes."""
        plan, m = self._plan, self._measurement
        policy = plan.active_regions.get(self.module) if plan is not None and m is not None else None
        lines: list[str] = (
            []
            if policy is None
            else sac_cost_lines(
                self.module, plan, m, self._baseline, [o.op for o in base_ops if op_choice(policy, o.op) == "recompute"]
            )
        )
        self.cost.value = (
            (
                "<ul style='margin:2px 0;font-size:90%'>"
                + "".join(f"<li>{html.escape(line)}</li>" for line in lines)
                + "</ul>"
            )
            if lines
            else ""
        )

    def toggle(self, op: str) -> W.ToggleButtons:
        """The save/recompute toggle of ``op`` in the current region."""
        return self._rows[op].toggle

    # -- user edits ------------------------------------------------------------------------
    def _user_preset(self, change) -> None:
        if self._syncing or self.module is None:
            return
        self.editor.set_region(self.module, change["new"])

    def _user_op(self, op: str, choice: str) -> None:
        if self._syncing or self.module is None:
            return
        if choice == "save" and op in self.blocked:  # greyed out; refuse a programmatic click too
            self._rebuild()
            return
        self.editor.set_op(self.module, op, choice)
