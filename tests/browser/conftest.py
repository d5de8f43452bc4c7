"""Fixtures for the real-browser tests: JupyterLab / Voila servers and a headless Chromium page.

Without /usr/bin/chromium (or the playwright client) the tests skip with the reason, except
under CI=true, where a missing browser is a failure: CI must really run them
(`bash scripts/test.sh` installs chromium).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import labharness as lh

ARTIFACTS = lh.ARTIFACTS


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser():
    reason = lh.chromium_missing_reason()
    if reason:
        if lh.in_ci():
            pytest.fail(f"CI=true but the browser tests cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = lh.launch_chromium(pw)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, request):
    """A fresh browser context and page; on failure a screenshot goes to artifacts/."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    pg = context.new_page()
    pg.console_errors = []  # type: ignore[attr-defined]
    pg.on("console", lambda m: m.type == "error" and pg.console_errors.append(m.text))
    pg.on("pageerror", lambda e: pg.console_errors.append(str(e)))
    yield pg
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        name = re.sub(r"[^\w.-]+", "_", request.node.name)
        try:
            lh.screenshot(pg, ARTIFACTS / f"FAILED-{name}.png")
        except Exception:
            pass
        if pg.console_errors:
            print("browser console errors:\n" + "\n".join(pg.console_errors[-20:]))
    context.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.when == "call":
        item.rep_call = rep
    return rep


@pytest.fixture
def lab_root(tmp_path):
    """The directory JupyterLab serves; tests write notebooks here."""
    d = tmp_path / "root"
    d.mkdir()
    return d


@pytest.fixture
def lab(lab_root, tmp_path, browser):
    """A running JupyterLab (stopped at teardown), kernel = this venv's Python."""
    server = lh.start_lab(lab_root, tmp_path / "jupyter")
    try:
        yield server
    finally:
        server.stop()
        log = server.log_path
        if log.exists():
            ARTIFACTS.mkdir(exist_ok=True)
            (ARTIFACTS / "browser-lab-server.log").write_text(log.read_text(errors="replace"))


@pytest.fixture
def voila_factory(tmp_path, browser):
    """Start Voila on a notebook: ``server = voila_factory(path)``; stopped at teardown."""
    servers = []

    def start(notebook: Path) -> lh.Server:
        server = lh.start_voila(notebook, tmp_path / f"voila{len(servers)}")
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()
