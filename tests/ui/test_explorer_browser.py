"""The explorer in a real JupyterLab (headless Chromium): a freeze click reruns the step and a tap
on the history scatter restores the plan tried first, with the widgets following.

Uses the browser harness of ``tests/browser`` (servers, Chromium, notebook helpers). The browser
part runs in a child process (this file as a script): Playwright's sync API cannot start twice in
one process, and ``tests/browser`` keeps a session-wide browser open. Skips without Chromium,
fails under CI=true without it (as the other browser tests do).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "browser"))
import labharness as lh  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.timeout(480)]

CELLS = [
    """\
from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore

session = Session(zoo.make("cnn", batch_size=8), repeats=1)
explorer = explore(session)
explorer""",
]

TAP_FIRST_HISTORY_POINT = """() => {
  for (const doc of (window.Bokeh && window.Bokeh.documents) || [])
    for (const m of doc.all_models)
      if (m.name === "history") {
        const index = m.data instanceof Map ? m.data.get("index") : m.data["index"];
        if (index && index.length >= 2) { m.selected.indices = [0]; return true; }
      }
  return false; }"""


def _expected_saved_bytes() -> dict[str, int]:
    from memsave_nb import zoo
    from memsave_nb.plan import Plan
    from memsave_nb.session import Session

    session = Session(zoo.make("cnn", batch_size=8), repeats=0)
    return {
        "baseline": session.baseline.saved_bytes,
        "stem": session.run(Plan(frozen=("stem",))).measurement.saved_bytes,
    }


def run_in_lab() -> None:
    """Open the notebook in Lab, click, tap, check; raises AssertionError on a mismatch."""
    from playwright.sync_api import sync_playwright

    expected = _expected_saved_bytes()
    tmp = Path(tempfile.mkdtemp(prefix="memsave-explorer-lab-"))
    root = tmp / "root"
    root.mkdir()
    lh.write_notebook(root / "explorer.ipynb", CELLS)
    server = lh.start_lab(root, tmp / "jupyter")
    try:
        with sync_playwright() as pw:
            browser = lh.launch_chromium(pw)
            try:
                page = browser.new_context(viewport={"width": 1500, "height": 1100}).new_page()
                lh.open_notebook(page, server, "explorer.ipynb")
                try:
                    _check(page, expected)
                except BaseException:
                    lh.screenshot(page, lh.ARTIFACTS / "FAILED-browser-explorer-history-tap.png")
                    raise
            finally:
                browser.close()
    finally:
        server.stop()


def _check(page, expected: dict[str, int]) -> None:
    lh.run_all(page, via="menu", timeout=240)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    ex.wait_for(state="visible", timeout=120_000)
    status = ex.locator(".memsave-status").first
    saved = ex.locator(".memsave-saved-bytes").first
    lh.wait_for_text(saved, f"{expected['baseline']:,} B", timeout=120)

    ex.locator(".memsave-freeze-stem input[type=checkbox]").first.click()
    lh.wait_for_text(saved, f"{expected['stem']:,} B", timeout=120)
    lh.wait_for_text(status, lambda t: t.strip().startswith("done"), timeout=60)

    # the Results tab: tap the baseline's point (what the TapTool does: select it in BokehJS)
    page.locator(".lm-TabBar-tab, .p-TabBar-tab", has_text="Results").first.click()
    deadline = time.monotonic() + 30
    while not page.evaluate(TAP_FIRST_HISTORY_POINT):
        assert time.monotonic() < deadline, "the history scatter never showed two plans"
        time.sleep(0.2)
    lh.wait_for_text(status, lambda t: "restored" in t, timeout=60)
    lh.wait_for_text(saved, f"{expected['baseline']:,} B", timeout=30)
    page.locator(".lm-TabBar-tab, .p-TabBar-tab", has_text="Layers").first.click()
    assert not ex.locator(".memsave-freeze-stem input[type=checkbox]").first.is_checked()
    ex.scroll_into_view_if_needed()
    lh.screenshot(page, lh.ARTIFACTS / "browser-explorer-history-tap.png")


def test_freeze_click_and_history_tap_in_lab():
    reason = lh.chromium_missing_reason()
    if reason:
        if lh.in_ci():
            pytest.fail(f"CI=true but the browser test cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


if __name__ == "__main__":
    run_in_lab()
    print("explorer in Lab: freeze click and history tap ok")
