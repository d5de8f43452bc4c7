"""Real-browser checks: JupyterLab and Voila render and drive ipywidgets + Bokeh (jupyter_bokeh).

The probe notebook is a stand-in for the explorer: a Checkbox whose observer updates a Label and
a Bokeh figure's ColumnDataSource. Pointing this at the real explorer means writing (or copying)
its notebook into ``lab_root``, clicking its freeze checkbox with ``widget_checkbox`` and reading
its saved-activation label with ``wait_for_text_change``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

import labharness as lh
from labharness import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

PROBE_CELLS = [
    ("markdown", "# Browser probe\nA checkbox drives a label and a Bokeh figure."),
    """\
import sys
import ipywidgets as W
import memsave_nb  # the kernel must see the project installed
from bokeh.io import output_notebook
from bokeh.models import ColumnDataSource
from bokeh.plotting import figure
from bokeh.resources import INLINE
from jupyter_bokeh import BokehModel

output_notebook(INLINE, hide_banner=True)  # offline: BokehJS inline, never the CDN""",
    """\
source = ColumnDataSource(data=dict(x=[0, 1, 2], top=[1, 2, 3]))
fig = figure(width=360, height=240, title="probe", toolbar_location=None,
             x_range=(-0.5, 2.5), y_range=(0, 10))
fig.vbar(x="x", top="top", width=0.8, source=source)

box = W.Checkbox(value=False, description="freeze probe")
label = W.Label(value="total: 6")
label.add_class("probe-label")

def on_change(change):
    top = [7, 8, 9] if change["new"] else [1, 2, 3]
    source.data = dict(x=[0, 1, 2], top=top)
    label.value = f"total: {sum(top)}"

box.observe(on_change, "value")
kernel = W.Label(value=sys.executable)
kernel.add_class("probe-kernel")
app = W.VBox([box, label, kernel, BokehModel(fig)])
app.add_class("probe-app")
app""",
]


def _check_probe(page, shot_name: str) -> None:
    """Click the checkbox; label and Bokeh figure must follow. Shared by Lab and Voila."""
    app = page.locator(".probe-app").first
    app.wait_for(state="visible", timeout=60_000)
    label = page.locator(".probe-label").first
    lh.wait_for_text(label, "total: 6")
    # The kernel runs the Python that runs the tests (the project's venv).
    lh.wait_for_text(page.locator(".probe-kernel").first, sys.executable)

    canvas = lh.bokeh_canvas(app)
    canvas.wait_for(state="visible", timeout=60_000)
    box = canvas.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 100, f"Bokeh canvas not laid out: {box}"
    deadline = time.monotonic() + 30
    while (ink_before := lh.canvas_ink(canvas)) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ink_before > 0, "Bokeh canvas shows no bars"
    assert lh.bokeh_source_data(page, "top") == [1, 2, 3]

    lh.widget_checkbox(page, "freeze probe").click()
    lh.wait_for_text(label, "total: 24")
    deadline = time.monotonic() + 30
    while lh.bokeh_source_data(page, "top") != [7, 8, 9] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lh.bokeh_source_data(page, "top") == [7, 8, 9], "Bokeh data source did not follow the checkbox"
    deadline = time.monotonic() + 30
    while (ink_after := lh.canvas_ink(canvas)) <= ink_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ink_after > ink_before, f"taller bars should cover more pixels ({ink_before} -> {ink_after})"

    app.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / shot_name)


def test_lab_checkbox_updates_label_and_bokeh(lab, lab_root, page):
    lh.write_notebook(lab_root / "probe.ipynb", PROBE_CELLS)
    lh.open_notebook(page, lab, "probe.ipynb")
    lh.run_all(page, via="menu")
    lh.assert_no_cell_errors(page)
    _check_probe(page, "browser-lab-probe.png")


def test_voila_app_renders_widgets(voila_factory, tmp_path, page):
    nb = lh.write_notebook(tmp_path / "app" / "probe.ipynb", PROBE_CELLS)
    server = voila_factory(nb)
    page.goto(server.url(), wait_until="domcontentloaded", timeout=90_000)
    # App mode: widgets shown, code hidden.
    _check_probe(page, "browser-voila-probe.png")
    assert page.locator(".jp-InputArea-editor, .CodeMirror, .cm-editor").count() == 0, "Voila shows code"
    assert not re.search(r"Traceback|Error", page.locator("body").inner_text()[:5000])


# The course's first notebook, once committed: it must run in Lab and serve as a Voila app.
# MEMSAVE_COURSE_NB=path/to.ipynb points these tests at another notebook.
COURSE_01 = [Path(p) for p in [os.environ.get("MEMSAVE_COURSE_NB", "")] if p] or sorted(
    (lh.ROOT / "notebooks").glob("01*.ipynb")
)
needs_course = pytest.mark.skipif(not COURSE_01, reason="notebooks/01*.ipynb does not exist yet")

# Notebook 01 explores the demo CNN on a batch of 8 (zoo.make("cnn", batch_size=8)); the test
# freezes the stem in the explorer and expects what the engine measures for that plan.
COURSE_01_MODEL, COURSE_01_BATCH = "cnn", 8
FREEZE = "stem"


@pytest.fixture(scope="module")
def course_01_expected():
    """Saved-activation bytes the engine gives for the baseline and for the stem frozen."""
    from memsave_nb import zoo
    from memsave_nb.plan import Plan
    from memsave_nb.session import Session

    session = Session(zoo.make(COURSE_01_MODEL, batch_size=COURSE_01_BATCH), repeats=1)
    frozen = session.run(Plan(frozen=(FREEZE,))).measurement.saved_bytes
    base = session.baseline.saved_bytes
    assert frozen < base, "freezing the stem must change the figure, or the click proves nothing"
    return {"baseline": base, "frozen": frozen}


def _saved_texts(nbytes: int) -> tuple[str, str]:
    """The two header labels as the explorer writes them (memsave_nb.ui.format)."""
    from memsave_nb.ui.format import format_bytes

    return format_bytes(nbytes), f"{nbytes:,} B"


def _check_explorer_shows(page, nbytes: int, *, timeout: float = 120) -> None:
    total, exact = _saved_texts(nbytes)
    explorer = page.locator(".memsave-explorer").first
    explorer.wait_for(state="visible", timeout=timeout * 1000)
    lh.wait_for_text(explorer.locator(".memsave-saved-bytes").first, exact, timeout=timeout)
    lh.wait_for_text(explorer.locator(".memsave-saved-total").first, total, timeout=timeout)


@needs_course
@pytest.mark.timeout(420)
def test_course_notebook_01_runs_in_lab(lab, lab_root, page, course_01_expected):
    nb = lh.copy_notebook(COURSE_01[0], lab_root)
    lh.open_notebook(page, lab, nb.name)
    start = time.monotonic()
    lh.run_all(page, via="menu", timeout=300)
    print(f"notebook 01 ran in Lab in {time.monotonic() - start:.1f} s")
    lh.assert_no_cell_errors(page)

    # The explorer shows the engine's baseline ...
    _check_explorer_shows(page, course_01_expected["baseline"])
    explorer = page.locator(".memsave-explorer").first
    box = explorer.locator(f".memsave-freeze-{FREEZE} input[type=checkbox]").first
    box.scroll_into_view_if_needed()
    assert not box.is_checked()
    # ... a click on the stem's freeze box reruns the step ...
    start = time.monotonic()
    box.click()
    assert box.is_checked()
    # ... and the saved-activation figure becomes what the engine gives for that plan.
    _check_explorer_shows(page, course_01_expected["frozen"])
    print(f"toggle to updated figure: {time.monotonic() - start:.1f} s")
    lh.wait_for_text(explorer.locator(".memsave-status").first, re.compile(r"^\s*done"))
    assert "-" in explorer.locator(".memsave-saved-delta").first.inner_text()  # a drop against the baseline
    lh.assert_no_cell_errors(page)
    explorer.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "browser-lab-course-01.png")


@needs_course
@pytest.mark.timeout(420)
def test_course_notebook_01_as_voila_app(voila_factory, tmp_path, page, course_01_expected):
    nb = lh.copy_notebook(COURSE_01[0], tmp_path)
    server = voila_factory(nb)
    page.goto(server.url(), wait_until="domcontentloaded", timeout=90_000)
    # App mode: the whole notebook runs, then the explorer renders with the engine's numbers.
    _check_explorer_shows(page, course_01_expected["baseline"], timeout=300)
    explorer = page.locator(".memsave-explorer").first
    assert page.locator(".cm-editor, .CodeMirror").count() == 0, "Voila shows code"
    assert "Traceback" not in page.locator("body").inner_text()
    # The app is live: its kernel reruns the step on a click, as in Lab.
    box = explorer.locator(f".memsave-freeze-{FREEZE} input[type=checkbox]").first
    box.scroll_into_view_if_needed()
    box.click()
    _check_explorer_shows(page, course_01_expected["frozen"])
    assert "Traceback" not in page.locator("body").inner_text()
    explorer.scroll_into_view_if_needed()
    lh.screenshot(page, ARTIFACTS / "browser-voila-course-01.png")
