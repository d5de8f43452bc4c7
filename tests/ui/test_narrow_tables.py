"""Issue 42's 700 px items as the widgets build them (the browser test checks the page itself):
the SAC op rows sit in one scroller with their header, column for column; the layer table's narrow
rules leave its numbers and controls within a 700 px notebook's output area; the GPUs table's
headers wrap there."""

from __future__ import annotations

import re

import pytest

from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui import layer_table
from memsave_nb.ui.explorer import Explorer
from memsave_nb.ui.styles import NARROW_TABLES_CSS

pytestmark = pytest.mark.timeout(120)

# the layer table of a 700 px JupyterLab notebook (file browser collapsed) is 548 px wide, measured
# in Chromium by tests/browser/test_sized_screens_lab.py
NARROW_BUDGET_PX = 548


@pytest.fixture(scope="module")
def mlp():
    ex = Explorer(Session(zoo.make("mlp"), "real", repeats=0), live=False)
    yield ex
    ex.close()


def _px(value: str) -> int:
    return int(value.removesuffix("px"))


def test_sac_rows_share_their_headers_scroller_and_columns(mlp):
    mlp._on_select("3")
    sac = mlp.sac
    assert sac.table.children[1] is sac.header and sac.table.children[2] is sac.ops_box
    assert "memsave-sac-table" in sac.table._dom_classes
    head_info, head_toggle = sac.header.children
    row = sac._rows["aten.relu"]
    assert _px(head_info.layout.width) == _px(row.info.layout.width)
    assert _px(head_toggle.layout.width) == _px(row.toggle.layout.width)
    assert "save or recompute" in head_toggle.value
    assert "memsave-sac-row" in row.box._dom_classes and "memsave-sac-opcell" in row.info.value


def test_layer_table_narrow_rules_fit_the_numbers_and_controls(mlp):
    css = layer_table.TABLE_CSS
    narrow = css[css.index("@container") :]
    width = {sel: int(px) for sel, px in re.findall(r"\.memsave-([\w-]+) \{ width: (\d+)px !important", narrow)}
    width.update(
        {sel: int(px) for sel, px in re.findall(r"\.memsave-([\w-]+), [^{]+\{ width: (\d+)px !important", narrow)}
    )
    freeze, memsave = layer_table._CONTROLS[0][1], layer_table._CONTROLS[1][1]
    total = width["name-cell"] + freeze + memsave + width["region"] + width["saved-cell"]
    assert total + 6 * 4 <= NARROW_BUDGET_PX, total  # each widget's 2 px margins
    assert width["col-saved"] + width["col-delta"] <= width["saved-cell"]
    # the classes those rules select are on the widgets
    row = mlp.table.rows["3"]
    assert "memsave-saved-cell" in row.info._dom_classes and "memsave-region" in row.region._dom_classes
    assert "memsave-col-saved" in row.info.value and "memsave-bar-track" in row.info.value
    assert "memsave-region-head" in mlp.table.header.children[3]._dom_classes


def test_gpus_table_headers_wrap_in_a_narrow_notebook():
    narrow = NARROW_TABLES_CSS[NARROW_TABLES_CSS.index("@container") :]
    assert "padding: 2px 2px !important; white-space: normal !important;" in narrow
    assert "container-type: inline-size" in NARROW_TABLES_CSS
