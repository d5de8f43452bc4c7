"""The explorer in a real JupyterLab page as people use it (issue 14):

- Run All, reload the tab, Run All again on the same kernel: every Bokeh figure draws (a canvas in
  each figure widget, no "javascript error" text, no ``Bokeh.require`` error in the console);
- at 700 px (file browser collapsed) the run/cancel buttons keep their words and the row controls (freeze, memsave,
  checkpoint) are on screen and work;
- a second view of the same output (Lab's "Create New View for Output") and a Voila page draw them too;
- a compile-budget run shows its progress (phase and elapsed seconds) and can be cancelled;
- screenshots for the README: wide (1400 px), narrow (700 px), dark theme, under artifacts/.
"""

from __future__ import annotations

import re
import time

import pytest

import labharness as lh
from labharness import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

CELLS = [
    ("markdown", "# Explorer views\nThe explorer on a small CNN and on a tiny MLP (for a compile budget)."),
    """\
import torch
from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore

explorer = explore(Session(zoo.make("cnn", batch_size=2), repeats=3), debounce_s=0.05)
explorer""",
    """\
torch.manual_seed(0)
mlp = zoo.mlp((32, 64, 10))
small = explore(mlp, torch.randn(8, 32), repeats=1, debounce_s=0.05)
small""",
]

FIGURES_PER_EXPLORER = 6  # history, peak split, timeline, layer bars, budget sweep, the planner's Pareto front

COUNT_CANVASES = """(explorer) => [...explorer.querySelectorAll('.memsave-bokeh')].map(fig => {
  let n = 0;
  const visit = (node) => {
    if (!node) return;
    if (node.tagName === 'CANVAS' && node.width > 0 && node.height > 0) n += 1;
    if (node.shadowRoot) visit(node.shadowRoot);
    for (const child of node.children || []) visit(child);
  };
  visit(fig);
  return n;
})"""


def _tab(explorer, title: str):
    explorer.locator(".lm-TabBar-tab, .p-TabBar-tab", has_text=title).first.click()


def _every_figure_draws(page, explorer, *, timeout: float = 90) -> list[int]:
    """Show each tab holding figures, then require a drawn canvas in every figure widget."""
    deadline = time.monotonic() + timeout
    counts: list[int] = []
    while time.monotonic() < deadline:
        _tab(explorer, "Compile budget")
        budget = explorer.evaluate(COUNT_CANVASES)
        _tab(explorer, "Results")
        results = explorer.evaluate(COUNT_CANVASES)
        counts = [max(a, b) for a, b in zip(budget, results)]
        if len(counts) == FIGURES_PER_EXPLORER and all(c > 0 for c in counts):
            break
        time.sleep(0.5)
    text = explorer.inner_text()
    assert "javascript error" not in text.lower(), "a figure shows 'Click to show javascript error'"
    assert len(counts) == FIGURES_PER_EXPLORER and all(c > 0 for c in counts), f"canvases per figure: {counts}"
    return counts


def _bokeh_errors(page) -> list[str]:
    return [e for e in page.console_errors if "require" in e or "Bokeh" in e]


def test_figures_survive_a_reload_and_run_all_on_the_same_kernel(lab, lab_root, page):
    lh.write_notebook(lab_root / "views.ipynb", CELLS)
    lh.open_notebook(page, lab, "views.ipynb")
    lh.run_all(page, via="menu", timeout=240)
    lh.assert_no_cell_errors(page)
    explorer = page.locator(".memsave-explorer").first
    lh.wait_for_text(explorer.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=120)
    print("first page, canvases per figure:", _every_figure_draws(page, explorer))
    _tab(explorer, "Layers")
    kernel_before = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id")

    # reload the tab without saving (the outputs that loaded BokehJS are gone): a new page on the
    # same kernel; Lab asks before leaving a notebook with unsaved changes, and the user says yes
    page.on("dialog", lambda dialog: dialog.accept())
    page.console_errors.clear()
    page.reload(wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=90_000)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(state="visible", timeout=90_000)
    lh.wait_kernel_idle(page, timeout=90)
    kernel_after = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id")
    assert kernel_after == kernel_before, "the reloaded page must talk to the same kernel"

    lh.run_all(page, via="menu", timeout=240)
    lh.assert_no_cell_errors(page)
    for i in range(page.locator(".memsave-explorer").count()):
        ex = page.locator(".memsave-explorer").nth(i)
        lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=120)
        print(f"after reload + Run All, explorer {i}:", _every_figure_draws(page, ex))
    assert not _bokeh_errors(page), "\n".join(_bokeh_errors(page))

    # a second view of the same output (Lab's "Create New View for Output"): figures draw there too
    page.locator(".jp-NotebookPanel .jp-CodeCell").nth(1).locator(".jp-InputArea-prompt").first.click()
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:create-output-view')")
    second = page.locator(".jp-LinkedOutputView .memsave-explorer").first
    second.wait_for(state="visible", timeout=60_000)
    print("second view of the output:", _every_figure_draws(page, second))
    page.evaluate(
        "() => { const w = window.jupyterapp.shell.currentWidget; if (w && w.node.querySelector('.jp-LinkedOutputView')) w.close(); }"
    )

    # wide: at 1400 px each header line (memory; time) stays one line
    explorer = page.locator(".memsave-explorer").first
    _tab(explorer, "Layers")
    rows = explorer.locator(".memsave-summary-row")
    assert rows.count() == 2
    for k in range(2):
        box = rows.nth(k).bounding_box()
        assert box and box["height"] < 40, f"header line {k} wraps at 1400 px: {box}"
    explorer.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "explorer-wide.png")

    # narrow: 700 px; buttons keep their words; row controls on screen and working
    page.set_viewport_size({"width": 700, "height": 1000})
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # a narrow screen: no file browser
    time.sleep(1.0)
    for cls, word in ((".memsave-run", "run"), (".memsave-cancel", "cancel")):
        button = explorer.locator(cls).first
        assert word in button.inner_text(), f"{cls} lost its words at 700 px"
        bb = button.bounding_box()
        assert bb and bb["width"] >= 80
    row = explorer.locator(".memsave-row-stem").first
    row.scroll_into_view_if_needed()
    for cls in (".memsave-freeze-stem input", ".memsave-swap-stem input", ".memsave-region-stem select"):
        bb = explorer.locator(cls).first.bounding_box()
        assert bb and bb["x"] >= 0 and bb["x"] + bb["width"] <= 700, f"{cls} is off-screen at 700 px: {bb}"
    saved = explorer.locator(".memsave-saved-bytes").first
    before = saved.inner_text()
    explorer.locator(".memsave-freeze-stem input").first.click()
    lh.wait_for_text_change(saved, before, timeout=120)
    lh.wait_for_text(explorer.locator(".memsave-status").first, re.compile(r"^\s*done"), timeout=120)
    lh.screenshot(page, ARTIFACTS / "explorer-narrow.png")
    page.set_viewport_size({"width": 1400, "height": 1000})

    # dark theme: bar tracks are not bright white
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=60_000)
    time.sleep(1.0)
    track = explorer.locator(".memsave-bar").first.locator("xpath=..")
    color = track.evaluate("el => getComputedStyle(el).backgroundColor")
    nums = [float(x) for x in re.findall(r"[\d.]+", color)]
    assert nums[:3] != [255.0, 255.0, 255.0] and nums[:3] != [238.0, 238.0, 238.0], color
    explorer.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "explorer-dark.png")
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Light'})")

    # a compile-budget run shows progress (phase, elapsed) and can be cancelled
    small = page.locator(".memsave-explorer").nth(1)
    small.scroll_into_view_if_needed()
    _tab(small, "Compile budget")
    small.locator(".memsave-compile input").first.click()
    progress = small.locator(".memsave-progress-text").first
    text = lh.wait_for_text(progress, re.compile(r"compiling.*\d+ s elapsed"), timeout=60)
    print("compile progress:", text)
    assert small.locator(".memsave-progress").first.is_visible()
    lh.screenshot(page, ARTIFACTS / "explorer-compile-progress.png")
    small.locator(".memsave-cancel").first.click()
    lh.wait_for_text(small.locator(".memsave-status").first, re.compile(r"^\s*(cancelled|done)"), timeout=240)


VOILA_CELLS = [
    """\
import torch
from memsave_nb import zoo
from memsave_nb.ui.explorer import explore

torch.manual_seed(0)
explore(zoo.mlp((32, 64, 10)), torch.randn(8, 32), repeats=1)""",
]


def test_figures_draw_in_voila(voila_factory, tmp_path, page):
    nb = lh.write_notebook(tmp_path / "app" / "explorer.ipynb", VOILA_CELLS)
    server = voila_factory(nb)
    page.goto(server.url(), wait_until="domcontentloaded", timeout=90_000)
    explorer = page.locator(".memsave-explorer").first
    explorer.wait_for(state="visible", timeout=180_000)
    print("Voila, canvases per figure:", _every_figure_draws(page, explorer))
    assert not _bokeh_errors(page), "\n".join(_bokeh_errors(page))
