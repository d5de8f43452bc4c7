"""The tuner and GPUs tabs in a real JupyterLab page (headless Chromium), as issue 28 asks: a
50-row front list keeps readable rows and scrolls; the Pareto scatter draws its headroom line
inside its y range; one click on a Pareto point runs the step exactly once; the GPUs tab shows
per-rank bars and a verdict. Screenshots go to artifacts/.

The expected planner numbers come from this process (the planner in fake mode is deterministic).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import labharness as lh
from labharness import ARTIFACTS
from test_tuner_lab import POINT_ON_PAGE, _set_gb

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

SETUP = """\
import ipywidgets as W
from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import Explorer

TINY = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
explorer = Explorer(Session(zoo.gpt(TINY, batch_size=4), mode="fake", repeats=0), debounce_s=0.05)
runs = []
count = W.HTML("runs: 0")
count.add_class("test-run-count")
explorer.on_result(lambda e: (runs.append(e), setattr(count, "value", f"runs: {len(runs)}")))
W.VBox([count, explorer])"""

FIFTY = """\
from memsave_nb.plan import Plan
from memsave_nb.planner import Candidate
from memsave_nb.ui.front_list import FrontList

def cand(full, n):
    regions = {f"blocks.{i}": "full" for i in range(full)}
    regions.update({f"blocks.{full + i}": "offload" for i in range(n)})
    return Candidate(Plan(regions=regions), "as given, as given", (1000 - 10 * full - n) << 20, (1 + full + n / 10) / 1e3, full < 5)

front = [cand(full, n) for full in range(10) for n in range(5)]
fifty = FrontList(lambda i: None)
fifty.add_class("test-fifty")
fifty.set_front(front, list(range(50)))
fifty.show(front, None)
fifty.show_all.value = True
fifty"""

MODEL_STATE = """([name]) => {
  for (const doc of (window.Bokeh && window.Bokeh.documents) || [])
    for (const m of doc.all_models)
      if (m.name === name) return {visible: m.visible, type: m.type};
  return null;
}"""

Y_RANGE = """([name]) => {
  const B = window.Bokeh;
  for (const view of [...B.index.query(v => v.model && v.model.name === name)]) {
    const rect = view.canvas_view && view.canvas_view.el.getBoundingClientRect();
    if (!rect || rect.width === 0) continue;
    const r = view.frame.y_range;
    return {start: r.start, end: r.end};
  }
  return null;
}"""


def _expected():
    from memsave_nb import zoo
    from memsave_nb.plan import Plan
    from memsave_nb.planner import plan_for
    from memsave_nb.target import Target

    tiny = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    workload = zoo.gpt(tiny, batch_size=4)
    return plan_for(workload, Target(24.0), mode="fake", device="H100", base_plan=Plan(), precisions=(None, "bf16"))


def test_front_list_scatter_line_one_click_one_run_and_gpu_bars(lab, lab_root, page):
    pool = ThreadPoolExecutor(1)
    expected_future = pool.submit(_expected)
    lh.write_notebook(lab_root / "tabs.ipynb", [SETUP, FIFTY])
    lh.open_notebook(page, lab, "tabs.ipynb")
    lh.run_all(page, via="command", timeout=150)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=60)
    result = expected_future.result(timeout=150)
    pool.shutdown()

    # 1. fifty rows: each keeps its height, the box scrolls, the last row can be scrolled to
    box = page.locator(".test-fifty").first
    box.scroll_into_view_if_needed()
    rows = box.locator(".memsave-front-row")
    assert rows.count() == 50
    heights = rows.evaluate_all("els => els.map(e => e.getBoundingClientRect().height)")
    print("row heights:", min(heights), max(heights))
    assert min(heights) >= 30, heights
    tops = rows.evaluate_all("els => els.map(e => e.getBoundingClientRect().top)")
    assert all(b - a >= 30 for a, b in zip(tops, tops[1:])), "rows overlap"
    sizes = box.evaluate("e => ({sh: e.scrollHeight, ch: e.clientHeight})")
    assert sizes["sh"] > sizes["ch"] + 1000 and sizes["ch"] <= 400, sizes
    lh.screenshot(page, ARTIFACTS / "tuner-front-fifty-top.png")
    box.evaluate("e => { e.scrollTop = e.scrollHeight; }")
    time.sleep(0.3)
    last, frame = rows.nth(49).bounding_box(), box.bounding_box()
    assert last is not None and frame is not None
    assert frame["y"] <= last["y"] and last["y"] + last["height"] <= frame["y"] + frame["height"] + 1
    lh.screenshot(page, ARTIFACTS / "tuner-front-fifty-scrolled.png")

    # 2. the Fit a GPU tab: a target between the front's peaks, search, the headroom line in range
    ex.locator(".lm-TabBar-tab", has_text="Fit a GPU").first.click()
    panel = ex.locator(".memsave-tuner-panel").first
    peaks = sorted(c.est_peak_bytes for c in result.front)
    usable_gb = peaks[len(peaks) // 2] / 2**30
    _set_gb(panel, f"{usable_gb / 0.8:.9f}")
    lh.wait_for_text(panel.locator(".memsave-verdict").first, re.compile(r"fit"), timeout=20)
    panel.locator(".memsave-plan-search").first.click()
    lh.wait_for_text(panel.locator(".memsave-tuner-status").first, re.compile(r"^\s*done"), timeout=90)
    panel.locator(".memsave-bokeh").first.scroll_into_view_if_needed()
    deadline = time.monotonic() + 30
    while (state := page.evaluate(MODEL_STATE, ["headroom_line"])) is None or page.evaluate(
        Y_RANGE, ["pareto_figure"]
    ) is None:
        assert time.monotonic() < deadline, "the scatter never drew"
        time.sleep(0.2)
    y = page.evaluate(Y_RANGE, ["pareto_figure"])
    print("headroom line:", state, "y range:", y)
    assert state["visible"] is True and state["type"] == "GlyphRenderer"
    line_bytes = float(f"{usable_gb / 0.8:.9f}") * 0.8 * 2**30
    assert y["start"] <= line_bytes <= y["end"]
    lh.screenshot(page, ARTIFACTS / "tuner-scatter-headroom-line.png")

    # 3. one click on a point: exactly one run
    counter = page.locator(".test-run-count").first
    before = int(counter.inner_text().split(":")[1])
    target = result.front[-1]
    where = page.evaluate(POINT_ON_PAGE, ["pareto_figure", target.est_seconds * 1e3, target.est_peak_bytes])
    assert where is not None
    page.mouse.click(where["x"], where["y"])
    lh.wait_for_text(counter, f"runs: {before + 1}", timeout=60)
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*done"), timeout=60)
    time.sleep(4)  # a second run, if any, would start within the debounce and finish by now
    assert counter.inner_text().strip() == f"runs: {before + 1}"
    lh.screenshot(page, ARTIFACTS / "tuner-one-click-one-run.png")

    # 4. the GPUs tab: bars and a verdict against the target
    ex.locator(".lm-TabBar-tab", has_text="GPUs").first.click()
    gpus = ex.locator(".memsave-parallel-size").first
    gpus.click()
    verdict = lh.wait_for_text(ex.locator(".memsave-parallel-verdict").first, re.compile(r"fit"), timeout=90)
    print("GPUs verdict:", verdict)
    deadline = time.monotonic() + 30
    while page.evaluate(MODEL_STATE, ["gpus_unseen"]) is None or page.evaluate(Y_RANGE, ["gpus_figure"]) is None:
        assert time.monotonic() < deadline, "the GPUs figure never drew"
        time.sleep(0.2)
    assert lh.bokeh_canvas(ex.locator(".memsave-parallel-figure").first).is_visible()
    table = ex.locator(".memsave-parallel-grid").first
    assert table.is_visible() and "parameters (shards)" in table.inner_text()
    ex.locator(".memsave-parallel-figure").first.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "gpus-tab-bars-verdict.png")
    # the deciding rank's allocated and dashed reserved lines under the bars (issue 40)
    deadline = time.monotonic() + 30
    while (lines := page.evaluate(TIMELINE_DATA, ["gpus_timeline"])) is None:
        assert time.monotonic() < deadline, "the rank timeline never drew"
        time.sleep(0.2)
    assert lines["n"] > 1 and 0 < lines["allocated"] <= lines["reserved"], lines
    timeline = lh.bokeh_canvas(ex.locator(".memsave-parallel-timeline").first)
    timeline.scroll_into_view_if_needed()
    assert timeline.is_visible()
    lh.screenshot(page, ARTIFACTS / "gpus-tab-rank-timeline.png")


TIMELINE_DATA = """([name]) => {
  for (const doc of (window.Bokeh && window.Bokeh.documents) || [])
    for (const m of doc.all_models)
      if (m.name === name && m.data) {
        const col = (k) => Array.from((m.data instanceof Map ? m.data.get(k) : m.data[k]) || []);
        const a = col("allocated"), r = col("reserved");
        return {n: r.length, allocated: Math.max(...a), reserved: Math.max(...r)};
      }
  return null;
}"""


CANVAS_BRIGHTNESS = """(c) => {
  const ctx = c.getContext('2d');
  if (!ctx || c.width === 0 || c.height === 0) return null;
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let sum = 0, n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i+3] > 0) { sum += (d[i] + d[i+1] + d[i+2]) / 3; n++; }
  return n ? sum / n : null;
}"""


def test_dark_theme_figures_are_dark_and_the_gpus_table_scrolls_at_700px(lab, lab_root, page):
    page.set_viewport_size({"width": 700, "height": 1000})
    lh.write_notebook(lab_root / "dark.ipynb", [SETUP])
    lh.open_notebook(page, lab, "dark.ipynb")
    # Settings > Theme > JupyterLab Dark, before the figures are drawn
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").first.click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Theme$")).first.hover()
    page.locator(".lm-Menu-itemLabel", has_text="JupyterLab Dark").first.click()
    page.wait_for_selector('body[data-jp-theme-light="false"]', state="attached", timeout=30_000)
    lh.run_all(page, via="command", timeout=150)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=60)
    # the empty planner plot: dark, not a large white box
    ex.locator(".lm-TabBar-tab", has_text="Fit a GPU").first.click()
    canvas = lh.bokeh_canvas(ex.locator(".memsave-tuner-panel").first)
    canvas.scroll_into_view_if_needed()
    deadline = time.monotonic() + 30
    while (brightness := canvas.evaluate(CANVAS_BRIGHTNESS)) is None or brightness > 100:
        assert time.monotonic() < deadline, f"the planner plot stayed light (mean {brightness})"
        time.sleep(0.3)
    print("planner plot brightness:", brightness)
    lh.screenshot(page, ARTIFACTS / "dark-theme-planner-plot.png")
    # the GPUs tab at 700 px: its table fits its box
    ex.locator(".lm-TabBar-tab", has_text="GPUs").first.click()
    ex.locator(".memsave-parallel-size").first.click()
    lh.wait_for_text(ex.locator(".memsave-parallel-verdict").first, re.compile(r"fit"), timeout=90)
    grid_box = ex.locator(".memsave-parallel-grid-box").first
    sizes = grid_box.evaluate("e => ({sw: e.scrollWidth, cw: e.clientWidth})")
    print("GPUs table at 700 px:", sizes)
    # issue 42: no sideways scroll any more at 700 px, headers and values wrap (styles.NARROW_TABLES_CSS)
    assert sizes["sw"] <= sizes["cw"] + 1
    gpus_canvas = lh.bokeh_canvas(ex.locator(".memsave-parallel-figure").first)
    gpus_canvas.scroll_into_view_if_needed()
    assert (gpus_canvas.evaluate(CANVAS_BRIGHTNESS) or 255) < 100
    lh.screenshot(page, ARTIFACTS / "dark-theme-gpus-700px.png")
