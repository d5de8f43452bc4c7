"""Notebooks 07 and 08 as shipped end with a live explorer, open on their own tab, in Lab and Voila.

07 ends on the tuner ("Fit a GPU") over its 1.3B fake workload, 08 on the per-rank sizing
("GPUs") over its 70B one. Run All (Lab) or the app (Voila) must leave a ``.memsave-explorer``
whose open tab is that one, its panel on screen, and no error. Heavy: each notebook's full run
(planner, FSDP2 sizing) takes minutes on a 2-core CPU.
"""

from __future__ import annotations

import time

import pytest

import labharness as lh

ARTIFACTS = lh.ARTIFACTS
RUN_S = 600  # one notebook's Run All on a loaded 2-core CPU

# notebook prefix -> (the tab it ends on, a DOM hook inside that tab's panel)
COURSE_TABS = {
    "07": ("Fit a GPU", ".memsave-tuner-panel"),
    "08": ("GPUs", ".memsave-gpus"),
}


def _notebook(prefix: str):
    (path,) = sorted((lh.ROOT / "notebooks").glob(f"{prefix}-*.ipynb"))
    return path


def _check_explorer_on_tab(page, prefix: str, *, timeout: float) -> None:
    title, hook = COURSE_TABS[prefix]
    explorer = page.locator(".memsave-explorer").last
    explorer.wait_for(state="visible", timeout=timeout * 1000)
    current = explorer.locator(".lm-TabBar-tab.lm-mod-current").first
    lh.wait_for_text(current, title, timeout=60)
    panel = explorer.locator(hook).first
    panel.wait_for(state="visible", timeout=60_000)
    panel.scroll_into_view_if_needed()
    # something to press and something to type into (the report: "no button and no input")
    assert explorer.locator("button:visible").count() > 0 and explorer.locator("input:visible").count() > 0


@pytest.mark.timeout(RUN_S + 300)
@pytest.mark.parametrize("prefix", sorted(COURSE_TABS))
def test_course_notebook_ends_with_an_explorer_in_lab(lab, lab_root, page, prefix):
    nb = lh.copy_notebook(_notebook(prefix), lab_root)
    lh.open_notebook(page, lab, nb.name)
    start = time.monotonic()
    lh.run_all(page, via="menu", timeout=RUN_S)
    print(f"notebook {prefix} ran in Lab in {time.monotonic() - start:.1f} s")
    lh.assert_no_cell_errors(page)
    _check_explorer_on_tab(page, prefix, timeout=60)
    lh.assert_no_cell_errors(page)
    lh.screenshot(page, ARTIFACTS / f"browser-lab-course-{prefix}-explorer.png")


@pytest.mark.timeout(RUN_S + 300)
@pytest.mark.parametrize("prefix", sorted(COURSE_TABS))
def test_course_notebook_ends_with_an_explorer_in_voila(voila_factory, tmp_path, page, prefix):
    nb = lh.copy_notebook(_notebook(prefix), tmp_path)
    server = voila_factory(nb)
    start = time.monotonic()
    # Voila streams the page while the cells run: the document is complete only at the end
    page.goto(server.url(), wait_until="commit", timeout=90_000)
    _check_explorer_on_tab(page, prefix, timeout=RUN_S)
    print(f"notebook {prefix} rendered in Voila in {time.monotonic() - start:.1f} s")
    assert page.locator(".cm-editor, .CodeMirror").count() == 0, "Voila shows code"
    assert "Traceback" not in page.locator("body").inner_text()
    lh.screenshot(page, ARTIFACTS / f"browser-voila-course-{prefix}-explorer.png")
