"""Issue 42's explorer items in a real JupyterLab page (headless Chromium):

- a model opened by name shows the batch and sequence it sized in its title (and still says it is
  sized as CUDA runs it); "max seq len" is enabled for it; the front list's rows do not all read
  "offload base_model.model.model.la…"; "none fits" reports the wait the user had;
- at 700 px (MLP demo): recomputing ``aten.relu`` in region ``3`` explains its +1.0 MiB on screen;
  the SAC op rows keep their header (same columns, same scroller); the layer table shows its
  numbers and controls without a sideways scroll; the GPUs table fits.

Screenshots under artifacts/: sized-named-title.png, sized-700px-sac.png, sized-700px-layers.png,
sized-700px-gpus.png.
"""

from __future__ import annotations

import re
import time

import pytest

import labharness as lh
from labharness import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

NAMED = """\
import time
from memsave_nb.ui.explorer import explore
CFG = dict(overrides=dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=256))
named = explore("llama-3.2-1b", lora=dict(r=4), batch_size=2, seq_len=48, repeats=0, debounce_s=0.05, **CFG)
named"""

MLP = """\
from memsave_nb import zoo
from memsave_nb.session import Session
from memsave_nb.ui.explorer import explore
mlp = explore(Session(zoo.make("mlp"), repeats=0), debounce_s=0.05)
mlp"""


def _tab(explorer, title: str) -> None:
    explorer.locator(".lm-TabBar-tab", has_text=title).first.click()


def _set_gb(explorer, gb: float) -> None:
    box = explorer.locator(".memsave-target-gb input").first
    box.fill(str(gb))
    box.press("Enter")


def test_named_model_says_what_it_sized_and_its_tuner_items(lab, lab_root, page):
    lh.write_notebook(lab_root / "named.ipynb", [NAMED])
    lh.open_notebook(page, lab, "named.ipynb")
    lh.run_all(page, via="command", timeout=240)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=180)
    title = ex.locator(".memsave-title").first.inner_text()
    print("title:", title)
    assert "(batch 2 × seq 48)" in title and "sized as CUDA runs it" in title
    lh.screenshot(page, ARTIFACTS / "sized-named-title.png")

    _tab(ex, "Fit a GPU")
    seq = ex.locator(".memsave-max-seq button, button.memsave-max-seq").first
    assert seq.is_enabled(), "max seq len is disabled for a model by name"
    # a search with room: the front's rows say what differs
    _set_gb(ex, 24)
    ex.locator(".memsave-plan-search").first.click()
    status = ex.locator(".memsave-tuner-status").first
    lh.wait_for_text(status, re.compile(r"^\s*done"), timeout=180)
    texts = [t.strip() for t in ex.locator(".memsave-front-row:visible .memsave-front-text").all_inner_texts()]
    print("front rows:", texts)
    assert texts and not any("base_model" in t for t in texts)
    labels = [t.split("\n")[0] for t in texts]
    assert len(set(labels)) == len(labels), labels
    assert "modules under base_model.model.model." in ex.locator(".memsave-front-list").first.inner_text()
    # nothing fits: the status says the wait from the click to the answer
    _set_gb(ex, 0.00001)
    t0 = time.monotonic()
    ex.locator(".memsave-plan-search").first.click()
    text = lh.wait_for_text(status, re.compile(r"none fits"), timeout=240)
    waited = time.monotonic() - t0
    said = float(re.search(r"\(([\d.]+) s\)", text).group(1))
    print(f"none fits: status says {said} s, the page waited {waited:.1f} s")
    assert said <= waited + 0.2 and said >= waited - 1.5, (said, waited)


def test_mlp_at_700px_sac_cost_headers_and_tables_fit(lab, lab_root, page):
    page.set_viewport_size({"width": 700, "height": 1000})
    lh.write_notebook(lab_root / "mlp.ipynb", [MLP])
    lh.open_notebook(page, lab, "mlp.ipynb")
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    lh.run_all(page, via="command", timeout=240)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=180)

    # the layer table: every row's numbers and controls in view without scrolling sideways
    table = ex.locator(".memsave-layer-table").first
    box = table.bounding_box()
    row = ex.locator(".memsave-row-3").first
    rights = {sel: row.locator(sel).first.bounding_box() for sel in (".memsave-region", ".memsave-saved-cell")}
    print("layer table", box, {k: (v["x"], v["x"] + v["width"]) for k, v in rights.items()})
    for sel, b in rights.items():
        assert b["x"] + b["width"] <= box["x"] + box["width"] + 1, f"{sel} needs a sideways scroll at 700 px"
    lh.screenshot(page, ARTIFACTS / "sized-700px-layers.png")

    # SAC: recompute relu in region 3; the cost is explained, the header stays over its columns
    row.locator(".memsave-row-name").first.click()
    _tab(ex, "SAC per op")
    ex.locator(".memsave-sac-op-aten-relu button", has_text="recompute").first.click()
    cost = lh.wait_for_text(ex.locator(".memsave-sac-cost").first, re.compile(r"1,048,576 B"), timeout=120)
    print("SAC cost:", cost)
    assert "outside the region: the output of aten.addmm in 2" in cost and "still kept" in cost
    sac = ex.locator(".memsave-sac-table").first
    head = ex.locator(".memsave-sac-head").first.bounding_box()
    op_row = ex.locator(".memsave-sac-row").first.bounding_box()
    print("SAC head", head, "row", op_row, sac.evaluate("e => [e.scrollWidth, e.clientWidth]"))
    assert abs(head["x"] - op_row["x"]) < 2 and abs(head["width"] - op_row["width"]) < 8  # the toggles' own margins
    assert head["y"] < op_row["y"] and head["height"] <= op_row["height"] + 4, "the header wrapped or sits elsewhere"
    sac.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
    time.sleep(0.3)
    head2, row2 = (
        ex.locator(".memsave-sac-head").first.bounding_box(),
        ex.locator(".memsave-sac-row").first.bounding_box(),
    )
    assert abs(head2["x"] - row2["x"]) < 2, "scrolled, the header no longer sits over the rows"
    lh.screenshot(page, ARTIFACTS / "sized-700px-sac.png")

    # the GPUs table: every column in view
    _tab(ex, "GPUs")
    ex.locator(".memsave-parallel-size").first.click()
    lh.wait_for_text(ex.locator(".memsave-parallel-verdict").first, re.compile(r"fit"), timeout=120)
    grid = ex.locator(".memsave-parallel-grid-box").first
    sizes = grid.evaluate("e => ({sw: e.scrollWidth, cw: e.clientWidth})")
    print("GPUs table at 700 px:", sizes)
    lh.screenshot(page, ARTIFACTS / "sized-700px-gpus.png")
    assert sizes["sw"] <= sizes["cw"] + 1, f"the GPUs table needs a sideways scroll at 700 px: {sizes}"


def test_notebook_10_tables_say_their_units_and_its_config_warns_of_nothing(lab, lab_root, page):
    src = lh.ROOT / "notebooks" / "10-from-your-trainer-config-and-back.ipynb"
    nb = lh.copy_notebook(src, lab_root)
    lh.open_notebook(page, lab, nb.name)
    lh.run_all(page, via="command", timeout=360)
    lh.assert_no_cell_errors(page)
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
    tables = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output table")
    assert tables.count() == 2
    for k in range(tables.count()):
        tds = [t.strip() for t in tables.nth(k).locator("tbody td").evaluate_all("els => els.map(e => e.textContent)")]
        print(f"table {k}:", tds)
        sizes = [t for t in tds if t not in ("fits", "does not fit")]
        assert sizes and all(re.fullmatch(r"\d+(\.\d)? (B|KiB|MiB|GiB)", t) for t in sizes), (
            sizes
        )  # one decimal, a unit
    # the user's config cell (SFTConfig from the fields it writes) shows no deprecation warning
    config_cell = cells.filter(has_text="my_fields = dict(").first
    out = config_cell.locator(".jp-OutputArea").first.text_content()
    assert "deprecated" not in out, out
    assert "all claims hold" in cells.last.locator(".jp-OutputArea").first.text_content()
    lh.screenshot(page, ARTIFACTS / "sized-notebook-10.png")
