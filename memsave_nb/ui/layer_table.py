"""The per-layer table: a collapsible module tree with saved activations and per-row controls.

Each row, left to right: the module's name (click it to show its ops in the SAC panel), a
freeze checkbox (ticking a parent ticks its children), a memory-saving-layer switch, a
checkpoint-region menu, then its saved activations as a bar with bytes and share of the total,
the change against the baseline, then type, output shape, trainable / frozen parameters (over the
subtree) and the parameters it shares with other modules (tied weights). The controls come right
after the name so they stay in view in a narrow (700 px) notebook; the table scrolls sideways for
the rest. Rows are built the first time their parent is expanded, so
a 7B-shaped model does not cost thousands of widgets up front.

DOM hooks (for browser tests): every row is ``.memsave-row.memsave-row-<slug>``; its controls are
``.memsave-freeze-<slug>``, ``.memsave-swap-<slug>`` and ``.memsave-region-<slug>``, where
``<slug>`` is the module name with dots as dashes and ``root`` for the model itself
(see :func:`memsave_nb.ui.tree.slug`).
"""

from __future__ import annotations

import html
from typing import Callable

import ipywidgets as W

from memsave_nb.measure import Measurement
from memsave_nb.measure.result import subtree_params

from .editor import REGION_CHOICES, PlanEditor
from .format import format_bytes, format_count, format_delta_bytes, format_share, format_shape
from .tree import ROOT, slug

ROW_HEIGHT = "26px"
NAME_WIDTH = 180
INDENT_PX = 14
BAR_PX = 70
# read-only cells: the numbers first (saved activations, change), then the controls, then details
# short titles (a 700 px notebook narrows these columns), their meaning on hover
_SAVED_COLUMNS = (("saved", BAR_PX + 140), ("change", 84))
_SAVED_TITLES = (
    "saved activations: bytes the step keeps for backward, share of the total",
    "change against the baseline",
)
_CONTROLS = (("freeze", 52), ("memsave", 72), ("checkpoint", 150))
_DETAIL_COLUMNS = (("type", 110), ("output", 120), ("params: trainable / frozen", 200), ("tied to", 200))
SAVED_WIDTH = sum(w for _, w in _SAVED_COLUMNS)
DETAIL_WIDTH = sum(w for _, w in _DETAIL_COLUMNS)
_SLACK = 8  # the HTML widget's own padding
NAME_CELL_WIDTH = 26 + NAME_WIDTH + 8  # expand arrow and name button, each with its 2 px margins

#: table styles, shown once per explorer (ipywidgets has no trait for a button's text alignment).
#: The table is the one sideways scroller: rows, the header and the rows' box are as wide as their
#: content and do not scroll themselves (ipywidgets boxes default to ``overflow: auto``, which made
#: every row its own hidden scroller at 700 px), and the name cell sticks to the left edge with the
#: page's background so the numbers scroll under it. In a narrow notebook (the table under 760 px,
#: a container query) the name column, the bar and the checkpoint menu narrow so that the numbers
#: and controls are read without scrolling (issue 42); only the details scroll into view.
TABLE_CSS = """<style>
.memsave-row-name.jupyter-button, .memsave-row-name.widget-button {
  text-align: left; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.memsave-row { border-bottom: 1px solid rgba(128,128,128,0.15); }
.memsave-row.memsave-selected { background: rgba(31,119,180,0.15); }
.memsave-expand.jupyter-button, .memsave-expand.widget-button { background: transparent; }
.memsave-table-header { border-bottom: 1px solid rgba(128,128,128,0.5); }
.memsave-layer-table { overflow-x: auto; overflow-y: hidden; }
.memsave-layer-table .memsave-rows, .memsave-layer-table .memsave-row,
.memsave-layer-table .memsave-table-header { min-width: max-content; overflow: visible; }
.memsave-layer-table .memsave-name-cell { position: sticky; left: 0; z-index: 2; overflow: hidden;
  background: var(--jp-layout-color1, #fff); }
.memsave-layer-table .memsave-selected .memsave-name-cell {
  background: linear-gradient(rgba(31,119,180,0.15), rgba(31,119,180,0.15)), var(--jp-layout-color1, #fff); }
.memsave-layer-table { container-type: inline-size; }
@container (max-width: 760px) {
  .memsave-layer-table .memsave-name-cell { width: 120px !important; }
  .memsave-layer-table .memsave-row-name { flex: 0 1 auto !important; min-width: 0 !important; }
  .memsave-layer-table .memsave-bar-track { display: none !important; }
  .memsave-layer-table .memsave-col-saved { width: 96px !important; }
  .memsave-layer-table .memsave-col-delta { width: 62px !important; }
  .memsave-layer-table .memsave-saved-cell { width: 166px !important; }
  .memsave-layer-table .memsave-region, .memsave-layer-table .memsave-region-head { width: 112px !important; }
}
.memsave-spinner { display: inline-block; width: 10px; height: 10px; margin-right: 4px;
  border: 2px solid #c6dbef; border-top-color: #1f77b4; border-radius: 50%;
  animation: memsave-spin 0.8s linear infinite; vertical-align: middle; }
@keyframes memsave-spin { to { transform: rotate(360deg); } }
</style>"""


def _cell(text: str, width: int, *, align: str = "left", title: str = "", style: str = "", cls: str = "") -> str:
    t = f' title="{html.escape(title)}"' if title else ""
    c = f' class="{cls}"' if cls else ""
    return (
        f'<span{t}{c} style="display:inline-block;width:{width}px;text-align:{align};overflow:hidden;'
        f'white-space:nowrap;text-overflow:ellipsis;vertical-align:middle;{style}">{text}</span>'
    )


def _nowrap(cells: list[str]) -> str:
    return '<div style="white-space:nowrap">' + "".join(cells) + "</div>"


def saved_html(saved: int | None, share: float | None, delta: int | None) -> str:
    """The row's saved activations (a bar, bytes, share of the total) and change against the baseline."""
    widths = [w for _, w in _SAVED_COLUMNS]
    frac = 0.0 if share is None else max(0.0, min(1.0, share))
    bar = (
        f'<span class="memsave-bar-track" style="display:inline-block;width:{BAR_PX}px;height:10px;'
        f'background:rgba(128,128,128,0.22);vertical-align:middle">'
        f'<span class="memsave-bar" style="display:block;width:{frac * BAR_PX:.1f}px;height:10px;background:#54a24b">'
        "</span></span>"
    )
    saved_text = f"{bar} {format_bytes(saved)} <small>{format_share(share)}</small>" if saved is not None else "-"
    if delta is None:
        delta_text, color = "-", "#888"
    else:
        delta_text = format_delta_bytes(delta) if delta else "="
        color = "#2ca02c" if delta < 0 else ("#d62728" if delta > 0 else "#888")
    return _nowrap(
        [
            _cell(saved_text, widths[0], cls="memsave-col-saved"),
            _cell(
                delta_text, widths[1], align="right", style=f"color:{color};padding-right:6px", cls="memsave-col-delta"
            ),
        ]
    )


def details_html(
    type_name: str, output_shape: tuple[int, ...] | None, trainable: int, frozen: int, tied: str = ""
) -> str:
    """The row's type, output shape, parameter counts (over its whole subtree) and ties."""
    widths = [w for _, w in _DETAIL_COLUMNS]
    shape = format_shape(output_shape)
    return _nowrap(
        [
            _cell(html.escape(type_name), widths[0], title=type_name, style="padding-left:6px"),
            _cell(html.escape(shape), widths[1], title=shape),
            _cell(f"{format_count(trainable)} / {format_count(frozen)}", widths[2]),
            _cell(html.escape(tied) if tied else "", widths[3], title=tied),
        ]
    )


def tied_by_module(model) -> dict[str, str]:
    """Module name -> "weight = lm_head.weight" for parameters shared with another module, from
    :func:`memsave_nb.hf.tied_parameters` when it exists ({} otherwise)."""
    try:
        from memsave_nb.hf import tied_parameters  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - ties are shown when the hf helper provides them
        return {}
    try:
        ties = tied_parameters(model)
    except Exception:  # noqa: BLE001
        return {}
    out: dict[str, list[str]] = {}
    for canonical, names in ties.items():
        names = tuple(dict.fromkeys((canonical, *names)))
        for name in names:
            owner, _, attr = name.rpartition(".")
            others = [n for n in names if n != name]
            if others:
                out.setdefault(owner, []).append(f"{attr} = {', '.join(others)}")
    return {k: "; ".join(dict.fromkeys(v)) for k, v in out.items()}


class LayerRow:
    """The widgets of one module's row."""

    def __init__(self, table: "LayerTable", name: str):
        self.name = name
        tree = table.editor.tree
        s = slug(name)
        depth = tree.depth(name)
        has_children = bool(tree.children[name])
        self.expand = W.Button(
            description="▸" if has_children else "",
            disabled=not has_children,
            tooltip="expand / collapse" if has_children else "",
            layout=W.Layout(
                width="26px",
                height=ROW_HEIGHT,
                padding="0",
                margin=f"0 0 0 {depth * INDENT_PX}px",
                flex="0 0 auto",
                visibility="visible" if has_children else "hidden",
            ),
        )
        self.expand.add_class("memsave-expand")
        short = name.rpartition(".")[2] if name else "(model)"
        self.select = W.Button(
            description=short,
            tooltip=f"{name or '(model)'}: show its ops in the selective-checkpointing panel",
            layout=W.Layout(
                width=f"{NAME_WIDTH - depth * INDENT_PX}px", height=ROW_HEIGHT, padding="0 4px", flex="0 0 auto"
            ),
        )
        self.select.style.button_color = "transparent"
        self.select.add_class("memsave-row-name")
        self.info = W.HTML(layout=W.Layout(height=ROW_HEIGHT, width=f"{SAVED_WIDTH + _SLACK}px", flex="0 0 auto"))
        self.info.add_class("memsave-saved-cell")
        self.details = W.HTML(layout=W.Layout(height=ROW_HEIGHT, width=f"{DETAIL_WIDTH + _SLACK}px", flex="0 0 auto"))
        self.freeze = W.Checkbox(
            value=False, indent=False, description="", layout=W.Layout(width=f"{_CONTROLS[0][1]}px", flex="0 0 auto")
        )
        self.freeze.add_class("memsave-freeze")
        self.freeze.add_class(f"memsave-freeze-{s}")
        if not tree.params[name]:
            self.freeze.disabled = True
            self.freeze.layout.visibility = "hidden"
        self.memsave = W.Checkbox(
            value=False, indent=False, description="", layout=W.Layout(width=f"{_CONTROLS[1][1]}px", flex="0 0 auto")
        )
        self.memsave.add_class("memsave-swap")
        self.memsave.add_class(f"memsave-swap-{s}")
        if not tree.swappable[name]:
            self.memsave.disabled = True
            self.memsave.layout.visibility = "hidden"
        self.region = W.Dropdown(
            options=list(REGION_CHOICES), value="none", layout=W.Layout(width=f"{_CONTROLS[2][1]}px", flex="0 0 auto")
        )
        self.region.add_class("memsave-region")
        self.region.add_class(f"memsave-region-{s}")
        if not has_children and not tree.params[name]:
            self.region.disabled = True
            self.region.layout.visibility = "hidden"
        # expand arrow and name in one cell that sticks to the left when the table scrolls sideways
        self.name_cell = W.HBox(
            [self.expand, self.select],
            layout=W.Layout(width=f"{NAME_CELL_WIDTH}px", flex="0 0 auto", align_items="center"),
        )
        self.name_cell.add_class("memsave-name-cell")
        self.box = W.HBox(
            [self.name_cell, self.freeze, self.memsave, self.region, self.info, self.details],
            layout=W.Layout(align_items="center", min_height=ROW_HEIGHT),
        )
        self.box.add_class("memsave-row")
        self.box.add_class(f"memsave-row-{s}")

        self.expand.on_click(lambda _b: table.toggle_expanded(name))
        self.select.on_click(lambda _b: table.select(name))
        self.freeze.observe(lambda ch: table._user_freeze(name, ch["new"]), "value")
        self.memsave.observe(lambda ch: table._user_memsave(name, ch["new"]), "value")
        self.region.observe(lambda ch: table._user_region(name, ch["new"]), "value")


class LayerTable(W.VBox):
    """The module tree as rows of widgets, bound to a :class:`PlanEditor`."""

    def __init__(
        self,
        editor: PlanEditor,
        *,
        max_open_rows: int = 40,
        on_select: Callable[[str], None] | None = None,
        tied: dict[str, str] | None = None,
    ):
        self.editor = editor
        self.tied = dict(tied or {})
        self.rows: dict[str, LayerRow] = {}
        self.expanded: set[str] = set()
        self.selected: str | None = None
        self.on_select = on_select
        self._syncing = False
        self._measurement: Measurement | None = None
        self._baseline: Measurement | None = None

        def head(text: str, width: int) -> W.HTML:
            return W.HTML(f"<b>{text}</b>", layout=W.Layout(width=f"{width}px", flex="0 0 auto"))

        # the header is laid out like a row, so its columns line up with the rows' widgets
        def heads(
            columns, width: int, cls: str = "", cell_cls: tuple[str, ...] = (), titles: tuple[str, ...] = ()
        ) -> W.HTML:
            w = W.HTML(
                _nowrap(
                    [
                        _cell(
                            f"<b>{h}</b>",
                            cw,
                            cls=cell_cls[i] if i < len(cell_cls) else "",
                            title=titles[i] if i < len(titles) else "",
                        )
                        for i, (h, cw) in enumerate(columns)
                    ]
                ),
                layout=W.Layout(width=f"{width + _SLACK}px", flex="0 0 auto"),
            )
            if cls:
                w.add_class(cls)
            return w

        control_heads = [head(h, w) for h, w in _CONTROLS]
        control_heads[2].add_class("memsave-region-head")

        name_head = W.HBox(
            [head("module", NAME_CELL_WIDTH - 4)],
            layout=W.Layout(width=f"{NAME_CELL_WIDTH}px", flex="0 0 auto", align_items="center"),
        )
        name_head.add_class("memsave-name-cell")
        self.header = W.HBox(
            [name_head]
            + control_heads
            + [
                heads(
                    _SAVED_COLUMNS,
                    SAVED_WIDTH,
                    "memsave-saved-cell",
                    ("memsave-col-saved", "memsave-col-delta"),
                    _SAVED_TITLES,
                )
            ]
            + [heads(_DETAIL_COLUMNS, DETAIL_WIDTH)],
            layout=W.Layout(min_height=ROW_HEIGHT, align_items="center"),
        )
        self.header.add_class("memsave-table-header")
        self.rows_box = W.VBox()
        self.rows_box.add_class("memsave-rows")
        self.expand_all = W.Button(description="expand all", layout=W.Layout(width="110px"))
        self.collapse_all = W.Button(description="collapse", layout=W.Layout(width="110px"))
        self.expand_all.on_click(
            lambda _b: self.set_expanded([n for n in editor.tree.names if editor.tree.children[n]])
        )
        self.collapse_all.on_click(lambda _b: self.set_expanded([ROOT]))
        super().__init__(
            [W.HTML(TABLE_CSS), self.header, self.rows_box], layout=W.Layout(overflow="auto hidden", max_width="100%")
        )
        self.add_class("memsave-layer-table")
        self.set_expanded(self._default_expanded(max_open_rows))

    # -- tree --------------------------------------------------------------------------------
    def _default_expanded(self, max_rows: int) -> list[str]:
        """Open level after level while the visible rows stay under ``max_rows``."""
        tree = self.editor.tree
        opened = [ROOT]
        visible = 1 + len(tree.children[ROOT])
        frontier = list(tree.children[ROOT])
        while frontier:
            nxt = [c for n in frontier for c in tree.children[n]]
            if not nxt or visible + len(nxt) > max_rows:
                break
            opened += [n for n in frontier if tree.children[n]]
            visible += len(nxt)
            frontier = nxt
        return opened

    def visible_names(self) -> list[str]:
        tree = self.editor.tree
        out: list[str] = []

        def visit(name: str) -> None:
            out.append(name)
            if name in self.expanded:
                for c in tree.children[name]:
                    visit(c)

        visit(ROOT)
        return out

    def row(self, name: str) -> LayerRow:
        """The row of ``name`` (built on first use)."""
        r = self.rows.get(name)
        if r is None:
            if name not in self.editor.tree.children:
                raise KeyError(f"no module named {name!r}")
            r = LayerRow(self, name)
            self.rows[name] = r
            self._sync_row(r)
        return r

    def set_expanded(self, names) -> None:
        self.expanded = set(names)
        self._relayout()

    def toggle_expanded(self, name: str) -> None:
        if name in self.expanded:
            self.expanded.discard(name)
        else:
            self.expanded.add(name)
        self._relayout()

    def reveal(self, name: str) -> LayerRow:
        """Expand the ancestors of ``name`` so its row shows; return the row."""
        parts = name.split(".") if name else []
        opened = {ROOT} | {".".join(parts[:k]) for k in range(1, len(parts))}
        if not opened <= self.expanded:
            self.expanded |= opened
            self._relayout()
        return self.row(name)

    def _relayout(self) -> None:
        names = self.visible_names()
        rows = [self.row(n) for n in names]
        for r in rows:
            if not r.expand.disabled:
                r.expand.description = "▾" if r.name in self.expanded else "▸"
        self.rows_box.children = tuple(r.box for r in rows)

    # -- selection ---------------------------------------------------------------------------
    def select(self, name: str) -> None:
        if self.selected is not None and self.selected in self.rows:
            self.rows[self.selected].select.style.font_weight = ""
            self.rows[self.selected].box.remove_class("memsave-selected")
        self.selected = name
        r = self.reveal(name)
        r.select.style.font_weight = "bold"
        r.box.add_class("memsave-selected")
        if self.on_select is not None:
            self.on_select(name)

    # -- user edits -> editor -----------------------------------------------------------------
    def _user_freeze(self, name: str, value: bool) -> None:
        if not self._syncing:
            self.editor.set_frozen(name, value)

    def _user_memsave(self, name: str, value: bool) -> None:
        if not self._syncing:
            self.editor.set_memsave(name, value)

    def _user_region(self, name: str, value: str) -> None:
        if self._syncing:
            return
        self.editor.set_region(name, value)
        self.select(name)

    # -- editor / measurement -> widgets ------------------------------------------------------
    def sync_controls(self) -> None:
        """Put every built row's controls in line with the editor (after any edit or a load)."""
        frozen = self.editor.frozen_boxes()
        swapped = self.editor.memsave_boxes()
        self._syncing = True
        try:
            for r in self.rows.values():
                self._set_controls(r, frozen, swapped)
        finally:
            self._syncing = False

    def _set_controls(self, r: LayerRow, frozen: dict[str, bool], swapped: dict[str, bool]) -> None:
        if r.freeze.value != frozen[r.name]:
            r.freeze.value = frozen[r.name]
        if r.memsave.value != swapped[r.name]:
            r.memsave.value = swapped[r.name]
        key = self.editor.region_key(r.name)
        if r.region.value != key:
            r.region.value = key

    def show(self, measurement: Measurement, baseline: Measurement | None) -> None:
        """Fill the read-only cells from a measurement (deltas against ``baseline``)."""
        self._measurement, self._baseline = measurement, baseline
        self._by_name = {m.name: m for m in measurement.modules}
        self._base_by_name = {m.name: m for m in baseline.modules} if baseline is not None else {}
        self._params = _rolled_params(measurement)
        for r in self.rows.values():
            self._fill(r)

    def _sync_row(self, r: LayerRow) -> None:
        self._syncing = True
        try:
            self._set_controls(r, self.editor.frozen_boxes(), self.editor.memsave_boxes())
        finally:
            self._syncing = False
        if self._measurement is not None:
            self._fill(r)

    def _fill(self, r: LayerRow) -> None:
        tree = self.editor.tree
        m = self._by_name.get(r.name)
        base = self._base_by_name.get(r.name)
        total = self._measurement.saved_bytes if self._measurement is not None else 0
        if m is None:  # e.g. a compiled run that saw no module boundaries
            value = saved_html(None, None, None)
            details = details_html(tree.type_names[r.name], None, 0, 0, self.tied.get(r.name, ""))
        else:
            delta = (m.saved_bytes - base.saved_bytes) if base is not None else None
            share = (m.saved_bytes / total) if total else 0.0
            trainable, frozen = self._params.get(r.name, (m.trainable_params, m.frozen_params))
            value = saved_html(m.saved_bytes, share, delta)
            details = details_html(m.type_name, m.output_shape, trainable, frozen, self.tied.get(r.name, ""))
        if r.info.value != value:
            r.info.value = value
        if r.details.value != details:
            r.details.value = details

    def displayed_saved_bytes(self, name: str) -> int | None:
        """The saved bytes the row of ``name`` shows (from the measurement it was filled from)."""
        m = getattr(self, "_by_name", {}).get(name)
        return None if m is None else m.saved_bytes


def _rolled_params(measurement: Measurement) -> dict[str, tuple[int, int]]:
    """(trainable, frozen) parameter counts per module over its whole subtree, a tied weight once."""
    return subtree_params(measurement.modules)
