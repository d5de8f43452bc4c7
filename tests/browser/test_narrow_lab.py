"""The explorer at 700 px, in a JupyterLab notebook (file browser collapsed) and in Voila
(issue 28, item 9), checked through the DOM:

- the per-layer table scrolls sideways inside its own box (scrollWidth > clientWidth) while the
  name column stays put (``position: sticky``): scrolled until the type column sits right of the
  names, and scrolled to its end, the names' left edge has not moved;
- no tab title is cut (each label's scrollWidth <= its clientWidth);
- every drawn figure canvas lies inside the output area's width (figures follow the container);
- in Lab's dark theme the sticky name column is dark too (it covers the scrolled numbers).

Screenshots under artifacts/: narrow-700px-<lab|voila>-layers-scrolled.png and one per tab with
figures.
"""

from __future__ import annotations

import re
import time

import pytest

import labharness as lh
from labharness import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

WIDTH = 700

CELLS = [
    """\
from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore

explorer = explore(Session(zoo.make("cnn", batch_size=2), repeats=1), debounce_s=0.05)
explorer""",
]

TAB_LABELS = """(ex) => [...ex.querySelectorAll('.lm-TabBar-tab .lm-TabBar-tabLabel')].map(
  l => ({title: l.textContent, sw: l.scrollWidth, cw: l.clientWidth}))"""

# left/right of every drawn canvas inside the explorer's figures (BokehJS draws in shadow roots)
CANVASES = """(ex) => {
  const out = [];
  const visit = (node) => {
    if (!node) return;
    if (node.tagName === 'CANVAS') {
      const b = node.getBoundingClientRect();
      if (b.width > 0 && b.height > 0) out.push({left: b.left, right: b.right});
    }
    if (node.shadowRoot) visit(node.shadowRoot);
    for (const c of node.children || []) visit(c);
  };
  for (const fig of ex.querySelectorAll('.memsave-bokeh')) visit(fig);
  const area = (ex.closest('.jp-OutputArea-output') || ex).getBoundingClientRect();
  return {area: {left: area.left, right: area.right}, canvases: out};
}"""


def _tab(explorer, title: str) -> None:
    explorer.locator(".lm-TabBar-tab", has_text=title).first.click()


def _canvases_inside(explorer, title: str, *, timeout: float = 60) -> dict:
    """Open ``title`` and wait until its figures are drawn, then return their canvases' extents."""
    _tab(explorer, title)
    deadline = time.monotonic() + timeout
    while not explorer.evaluate(CANVASES)["canvases"]:
        assert time.monotonic() < deadline, f"no figure drew in the {title!r} tab"
        time.sleep(0.3)
    time.sleep(0.5)  # the figures' relayout to the container's width
    return explorer.evaluate(CANVASES)


def test_explorer_at_700px_scrolls_its_table_keeps_tab_titles_and_fits_its_figures(lab, lab_root, page):
    page.set_viewport_size({"width": WIDTH, "height": 1000})
    lh.write_notebook(lab_root / "narrow.ipynb", CELLS)
    lh.open_notebook(page, lab, "narrow.ipynb")
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # a narrow screen: no file browser
    lh.run_all(page, via="command", timeout=240)
    lh.assert_no_cell_errors(page)
    explorer = page.locator(".memsave-explorer").first
    lh.wait_for_text(explorer.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=120)
    area = explorer.evaluate("ex => ex.closest('.jp-OutputArea-output').getBoundingClientRect().width")
    assert area < WIDTH - 60, f"the output area is {area} px wide: not a 700 px notebook"
    _narrow_checks(page, explorer, "lab")

    # dark theme: the sticky name column takes the page's (dark) background, not white
    page.evaluate("() => window.jupyterapp.commands.execute('apputils:change-theme', {theme: 'JupyterLab Dark'})")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=60_000)
    time.sleep(1.0)
    _tab(explorer, "Layers")
    table = explorer.locator(".memsave-layer-table").first
    table.evaluate("e => { e.scrollLeft = 300; }")
    name = explorer.locator(".memsave-row-stem .memsave-name-cell").first
    color = name.evaluate("e => getComputedStyle(e).backgroundColor")
    rgb = [float(x) for x in re.findall(r"[\d.]+", color)[:3]]
    assert len(rgb) == 3 and sum(rgb) < 3 * 100, f"the name column is not dark in the dark theme: {color}"
    name.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "narrow-700px-lab-dark-layers-scrolled.png")


def _narrow_checks(page, explorer, where: str) -> None:
    """Tab titles whole, the layer table scrolling under a sticky name column, figures inside
    the output area; screenshots named after ``where`` (lab, voila)."""
    # tab titles: none cut
    labels = explorer.evaluate(TAB_LABELS)
    print("tab labels (scrollWidth, clientWidth):", [(t["title"], t["sw"], t["cw"]) for t in labels])
    assert {"Layers", "Compile budget", "Plan as code", "GPUs", "Fit a GPU"} <= {t["title"] for t in labels}
    cut = [t for t in labels if t["sw"] > t["cw"]]
    assert not cut, f"tab titles cut at {WIDTH} px: {cut}"

    # the layer table: one sideways scroller, the name column sticky
    _tab(explorer, "Layers")
    table = explorer.locator(".memsave-layer-table").first
    sizes = table.evaluate("e => ({sw: e.scrollWidth, cw: e.clientWidth, ox: getComputedStyle(e).overflowX})")
    print("layer table at 700 px:", sizes)
    assert sizes["sw"] > sizes["cw"] and sizes["ox"] in ("auto", "scroll"), sizes
    row = explorer.locator(".memsave-row-stem").first
    name = row.locator(".memsave-name-cell").first
    assert name.evaluate("e => getComputedStyle(e).position") == "sticky"
    type_cell = row.get_by_text("Sequential", exact=True).first
    table_box = table.bounding_box()
    tb0 = type_cell.bounding_box()  # issue 42: the numbers and controls fit; the details start at the edge
    assert tb0["x"] + tb0["width"] > table_box["x"] + table_box["width"], "the type column was already in view"
    before, type_before = name.bounding_box(), type_cell.bounding_box()
    # scroll until the type column sits just right of the name column, as a user would
    shift = type_before["x"] - (before["x"] + before["width"])
    table.evaluate("(e, dx) => { e.scrollLeft = dx; }", shift)
    time.sleep(0.3)
    assert table.evaluate("e => e.scrollLeft") >= shift - 1, "the table did not scroll that far"
    after = name.bounding_box()
    assert abs(after["x"] - before["x"]) < 2, f"the name column moved with the scroll: {before} -> {after}"
    tb = type_cell.bounding_box()
    assert (
        after["x"] + after["width"] - 1 <= tb["x"] and tb["x"] + tb["width"] <= table_box["x"] + table_box["width"] + 1
    ), f"scrolled, the type column is not in view right of the names: {tb}, names {after}, table {table_box}"
    lh.screenshot(page, ARTIFACTS / f"narrow-700px-{where}-layers-scrolled.png")
    table.evaluate("e => { e.scrollLeft = e.scrollWidth; }")  # to the end: the names still stay
    time.sleep(0.3)
    assert abs(name.bounding_box()["x"] - before["x"]) < 2
    table.evaluate("e => { e.scrollLeft = 0; }")

    # figures: every canvas inside the output area
    for title in ("Results", "Compile budget", "Fit a GPU"):
        got = _canvases_inside(explorer, title)
        left, right = got["area"]["left"], got["area"]["right"]
        outside = [c for c in got["canvases"] if c["left"] < left - 1 or c["right"] > right + 1]
        print(f"{title}: {len(got['canvases'])} canvases within [{left:.0f}, {right:.0f}]")
        assert not outside, f"{title}: canvases beyond the output area [{left}, {right}]: {outside}"
        explorer.locator(".memsave-bokeh:visible").first.scroll_into_view_if_needed()
        lh.screenshot(page, ARTIFACTS / f"narrow-700px-{where}-{title.lower().replace(' ', '-')}.png")


def test_explorer_at_700px_in_voila(voila_factory, tmp_path, page):
    page.set_viewport_size({"width": WIDTH, "height": 1000})
    nb = lh.write_notebook(tmp_path / "app" / "narrow.ipynb", CELLS)
    server = voila_factory(nb)
    page.goto(server.url(), wait_until="domcontentloaded", timeout=90_000)
    explorer = page.locator(".memsave-explorer").first
    explorer.wait_for(state="visible", timeout=180_000)
    lh.wait_for_text(explorer.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=120)
    _narrow_checks(page, explorer, "voila")
