"""Issue 42 in a real JupyterLab page (headless Chromium): a student turns "offload to host" on for
one block of a tiny GPT; the header shows the host bytes the engine measures for that plan (this
process measures the same plan with ``Plan.apply`` + ``measure``) and still keeps each line on one
line at 1400 px; the "Rule of thumb" tab shows rule_of_thumb's numbers, is readable in the dark
theme, and keeps every column in view at 700 px."""

from __future__ import annotations

import re
import time

import pytest

import labharness as lh
from labharness import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

SETUP = """\
import torch
from memsave_nb import zoo
from memsave_nb.ui.explorer import explore

torch.manual_seed(0)
TINY = zoo.GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
explore(zoo.gpt(TINY, batch_size=2), repeats=0, debounce_s=0.05)"""


def _expected():
    import torch

    from memsave_nb import zoo
    from memsave_nb.measure import measure
    from memsave_nb.measure.rule_of_thumb import teacher_view
    from memsave_nb.plan import Plan
    from memsave_nb.ui.format import format_bytes

    torch.manual_seed(0)
    tiny = zoo.GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    wl = zoo.gpt(tiny, batch_size=2)
    with Plan(regions={"blocks.0": "offload"}).apply(wl) as applied:
        m = measure(applied, mode="real", repeats=0)
        view = teacher_view(m, applied.model, "adamw")
    host = f"host {format_bytes(m.host.peak_bytes)}, {format_bytes(m.host.to_host_bytes)} moved/step"
    return host, format_bytes(view.parts[0].rule_bytes), m.host.to_host_bytes


def _tab(explorer, title: str) -> None:
    explorer.locator(".lm-TabBar-tab", has_text=title).first.click()


def _luminance(color: str) -> float:
    r, g, b = (float(x) for x in re.findall(r"[\d.]+", color)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_offload_one_block_shows_host_bytes_and_the_rule_of_thumb_tab(lab, lab_root, page):
    host_text, weights_rule, moved = _expected()
    assert moved > 0
    lh.write_notebook(lab_root / "teach.ipynb", [SETUP])
    lh.open_notebook(page, lab, "teach.ipynb")
    lh.run_all(page, via="command", timeout=180)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=120)
    assert not ex.locator(".memsave-host").first.is_visible()  # nothing offloaded: no label

    ex.locator(".memsave-region-blocks-0 select").first.select_option(label="offload to host")
    shown = lh.wait_for_text(ex.locator(".memsave-host").first, re.compile(r"moved/step"), timeout=120)
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*done"), timeout=120)
    print("host label:", shown, "expected:", host_text)
    assert shown.strip() == host_text
    rows = ex.locator(".memsave-summary-row")
    assert rows.count() == 2
    for k in range(2):
        box = rows.nth(k).bounding_box()
        assert box and box["height"] < 40, f"header line {k} wraps at 1400 px with the host label: {box}"

    _tab(ex, "Rule of thumb")
    table = ex.locator(".memsave-teach-rule-table").first
    table.wait_for(state="visible", timeout=30_000)
    weights = [c.strip() for c in table.locator("tr[data-part='weights'] td").all_inner_texts()]
    state = [c.strip() for c in table.locator("tr[data-part='optimizer state'] td").all_inner_texts()]
    print("weights row:", weights, "state row:", state)
    assert weights[2] == "4 B" and weights[3] == weights_rule and state[2] == "8 B"
    assert ex.locator(".memsave-teach-phase-table tr[data-part='backward']").count() == 1
    lh.screenshot(page, ARTIFACTS / "explorer-rule-of-thumb.png")

    # dark theme: the tables' text is light
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=60_000)
    time.sleep(1.0)
    cell = table.locator("tr[data-part='weights'] td").first
    color = cell.evaluate("e => getComputedStyle(e).color")
    assert _luminance(color) > 0.5, f"the rule table's text is dark in the dark theme: {color}"
    lh.screenshot(page, ARTIFACTS / "explorer-rule-of-thumb-dark.png")

    # 700 px, file browser collapsed: every column of both tables in view, no sideways scroll
    page.set_viewport_size({"width": 700, "height": 1000})
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    time.sleep(1.0)
    for cls in (".memsave-teach-rule .memsave-teach-box", ".memsave-teach-phases .memsave-teach-box"):
        sizes = ex.locator(cls).first.evaluate("e => ({sw: e.scrollWidth, cw: e.clientWidth})")
        print(cls, "at 700 px:", sizes)
        assert sizes["sw"] <= sizes["cw"] + 1, f"{cls} scrolls sideways at 700 px: {sizes}"
    lh.screenshot(page, ARTIFACTS / "explorer-rule-of-thumb-700px.png")
