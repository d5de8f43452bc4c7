"""The explorer opened on a target in a real JupyterLab page (headless Chromium): the Fit a GPU
tab's verdict line and the header read the allocator replay's answer (``target.fit_of``: the CLI's
and the planner's test) with the predicted reserved memory on screen, and say which rule decided.

The expected text comes from this process: the same fake-mode measurement of the same workload,
judged by ``fit_of``."""

from __future__ import annotations

import re

import pytest

import labharness as lh

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

SETUP = """\
from memsave_nb import zoo
from memsave_nb.ui.explorer import explore

TINY = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
explore(zoo.gpt(TINY, batch_size=64), mode="fake", repeats=0, target_gb=0.5, tab="Fit a GPU")"""


def _expected():
    from memsave_nb import zoo
    from memsave_nb.measure import measure
    from memsave_nb.target import Target, fit_of
    from memsave_nb.units import format_bytes

    tiny = zoo.GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    m = measure(zoo.gpt(tiny, batch_size=64), mode="fake", repeats=0)
    fit = fit_of(Target(0.5), m)
    return m, fit.fits, fit.verdict(Target(0.5)), format_bytes(m.reserved.max_reserved_bytes)


def test_the_verdict_line_shows_predicted_reserved_and_names_its_rule(lab, lab_root, page):
    m, fits, shown, reserved = _expected()
    # 512 MiB of GPU: 500 MiB of CUDA context leaves 12 MiB, the step's 12 MiB of segments fit exactly
    assert fits and shown.startswith("fits (512.0 MiB of 512.0 MiB; allocator replay + CUDA context, no 80% rule")
    lh.write_notebook(lab_root / "verdict.ipynb", [SETUP])
    lh.open_notebook(page, lab, "verdict.ipynb")
    lh.run_all(page, via="command", timeout=120)
    lh.assert_no_cell_errors(page)
    ex = page.locator(".memsave-explorer").first
    lh.wait_for_text(ex.locator(".memsave-status").first, re.compile(r"^\s*idle"), timeout=60)
    panel = ex.locator(".memsave-tuner-panel").first
    verdict = lh.wait_for_text(panel.locator(".memsave-verdict").first, re.compile(r"allocator replay"), timeout=30)
    print("verdict line:", verdict)
    assert "0.5 GB: " + shown in verdict.replace("\n", " ")
    assert f"predicted reserved {reserved}" in verdict and "CUDA context 500.0 MiB" in verdict
    assert "memsave-fits" in (panel.locator(".memsave-verdict b").first.get_attribute("class") or "")
    assert "rule: allocator replay" in panel.locator(".memsave-rule").first.inner_text()
    header = lh.wait_for_text(ex.locator(".memsave-target-verdict").first, re.compile(r"fits"), timeout=10)
    assert header.strip() == "✔ " + shown
    assert ex.locator(".memsave-reserved").first.inner_text() == f"reserved {reserved}"
    assert f"{m.peak_bytes:,} B" in ex.locator(".memsave-peak-bytes").first.inner_text()
