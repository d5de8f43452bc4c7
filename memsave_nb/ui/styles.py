"""Page styles the explorer brings with it (one hidden ``<style>`` widget per explorer).

ipywidgets gives each tab of a ``Tab`` a share of the row (``flex: 0 1 144px``): seven tabs in a
700 px notebook got 84 px each and "Compile budget", "SAC per op" and "Plan as code" were cut
to "Compile bu…". Here the tabs keep the width of their titles and the tab bar wraps onto a
second line instead. In a narrow notebook the GPUs tab's per-rank table wraps its headers and
narrows its padding so that every column is in view (issue 42). The layer table's own rules (sticky name column, sideways scrolling) live
with it in ``layer_table.TABLE_CSS``.
"""

from __future__ import annotations

import ipywidgets as W

_TAB = ".memsave-explorer .jupyter-widgets.jupyter-widget-tab > .lm-TabBar"

EXPLORER_CSS = f"""<style>
{_TAB} .lm-TabBar-content {{ flex-wrap: wrap; }}
{_TAB} .lm-TabBar-tab {{ flex: 0 0 auto; min-width: 0; }}
{_TAB} .lm-TabBar-tabLabel {{ overflow: visible; }}
</style>"""

#: the GPUs tab's per-rank table in a narrow notebook (a container query on its scroll box): smaller
#: type, headers and values wrap (a value between its number and its unit), so every column is in view
NARROW_TABLES_CSS = """<style>
.memsave-explorer .memsave-parallel-grid-box { container-type: inline-size; }
@container (max-width: 760px) {
  .memsave-explorer .memsave-parallel-grid { font-size: 10.5px !important; }
  .memsave-explorer .memsave-parallel-grid th, .memsave-explorer .memsave-parallel-grid td {
    padding: 2px 2px !important; white-space: normal !important; }
  .memsave-explorer .memsave-parallel-grid th { vertical-align: bottom; overflow-wrap: anywhere; hyphens: auto; }
}
</style>"""


#: the "Rule of thumb" tab's tables (ui/explorer_teach.py): theme colours (readable in the dark theme),
#: numbers right-aligned; in a narrow notebook smaller type and wrapping cells keep every column in view
_T = ".memsave-explorer .memsave-teach-table"
TEACH_CSS = f"""<style>
.memsave-explorer .memsave-teach-box {{ container-type: inline-size; overflow-x: auto; max-width: 100%; }}
{_T} {{ border-collapse: collapse; font-size: 90%; line-height: 1.35; margin: 4px 0;
  color: var(--jp-content-font-color1, inherit); }}
{_T} th, {_T} td {{ padding: 2px 8px; text-align: right; white-space: nowrap;
  border-bottom: 1px solid var(--jp-border-color2, #ddd); }}
{_T} th:first-child, {_T} td:first-child {{ text-align: left; }}
{_T} tr[data-part="total"] td {{ font-weight: bold; }}
.memsave-explorer .memsave-teach-line, .memsave-explorer .memsave-teach-intro {{ margin: 2px 0; font-size: 90%;
  line-height: 1.35; color: var(--jp-content-font-color1, inherit); }}
@container (max-width: 760px) {{
  {_T} {{ font-size: 11px; }}
  {_T} th, {_T} td {{ padding: 2px 3px; white-space: normal; }}
  {_T} th {{ vertical-align: bottom; }}
}}
</style>"""


def explorer_style() -> W.HTML:
    """A hidden widget carrying :data:`EXPLORER_CSS` (a ``<style>`` applies wherever it sits)."""
    w = W.HTML(EXPLORER_CSS, layout=W.Layout(display="none"))
    w.add_class("memsave-explorer-style")
    return w


def narrow_tables_style() -> W.HTML:
    """A hidden widget carrying :data:`NARROW_TABLES_CSS`."""
    w = W.HTML(NARROW_TABLES_CSS, layout=W.Layout(display="none"))
    w.add_class("memsave-narrow-tables-style")
    return w


def teach_style() -> W.HTML:
    """A hidden widget carrying :data:`TEACH_CSS`."""
    w = W.HTML(TEACH_CSS, layout=W.Layout(display="none"))
    w.add_class("memsave-teach-style")
    return w
