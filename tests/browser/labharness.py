"""Helpers that drive JupyterLab and Voila in headless Chromium (Debian's, through Playwright).

Used by ``tests/browser``; kept free of pytest fixtures so a test can combine them freely:

    server = start_lab(root_dir, workdir)             # JupyterLab on 127.0.0.1, free port, token
    page.goto(server.url("lab/tree/nb.ipynb"))
    nb = open_notebook(page, server, "nb.ipynb")      # waits for Lab, the panel and an idle kernel
    run_all(page)                                     # Run > Run All Cells, waits until done
    assert_no_cell_errors(page)
    widget_checkbox(page, "freeze").click()
    wait_for_text(page.locator(".some-label"), r"\\d+ MB")
    server.stop()

Isolation: every server gets its own Jupyter config/data/runtime dirs, settings and workspaces
under ``workdir``, and a ``python3`` kernelspec pointing at ``sys.executable`` (the Python that
runs the tests: the project's venv), so nothing in ``~/.jupyter`` or ``~/.local`` leaks in and
the kernel sees the project installed. BokehJS is loaded inline (``BOKEH_RESOURCES=inline``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"  # gitignored: screenshots and server logs land here

CHROMIUM = os.environ.get("MEMSAVE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]

KERNEL_NAME = "python3"
KERNELSPEC = {"name": KERNEL_NAME, "display_name": "Python 3 (memsave_nb)", "language": "python"}


# --------------------------------------------------------------------------- notebooks


def write_notebook(path: Path, cells: Sequence[str | tuple[str, str]]) -> Path:
    """Write a notebook with kernelspec metadata (without it Lab stops on a kernel dialog).

    ``cells``: source strings (code cells) or ``("markdown", source)`` pairs.
    """
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for cell in cells:
        if isinstance(cell, tuple):
            kind, src = cell
            nb.cells.append(
                nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
            )
        else:
            nb.cells.append(nbformat.v4.new_code_cell(cell))
    nbformat.validate(nb)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def copy_notebook(src: Path, dest_dir: Path) -> Path:
    """Copy a notebook into a server root (kernelspec required: Lab would block on a dialog)."""
    import nbformat

    nb = nbformat.read(str(src), as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name"), f"{src} has no kernelspec metadata"
    dest = Path(dest_dir) / Path(src).name
    nbformat.write(nb, str(dest))
    return dest


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_jupyter_env(workdir: Path) -> dict[str, str]:
    """Environment for a server (and its kernels) that ignores the user's Jupyter state."""
    workdir = Path(workdir)
    dirs = {name: workdir / name for name in ("config", "data", "runtime", "ipython", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    # Kernel = the Python running the tests (the project's venv), found first on the data path.
    kdir = dirs["data"] / "kernels" / KERNEL_NAME
    kdir.mkdir(parents=True, exist_ok=True)
    (kdir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": KERNELSPEC["display_name"],
                "language": "python",
                "metadata": {"debugger": False},
            }
        )
    )
    # Lab settings: no news/update toasts over the widgets.
    notif = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    notif.mkdir(parents=True, exist_ok=True)
    (notif / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(dirs["config"]),
        JUPYTER_DATA_DIR=str(dirs["data"]),
        JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
        JUPYTER_PLATFORM_DIRS="1",
        IPYTHONDIR=str(dirs["ipython"]),
        BOKEH_RESOURCES="inline",
        PYTHONUNBUFFERED="1",
    )
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTERLAB_SETTINGS_DIR", None)
    env.pop("JUPYTERLAB_WORKSPACES_DIR", None)
    return env


class ServerError(RuntimeError):
    pass


class Server:
    """A Jupyter-family server process on 127.0.0.1 that we started and will stop."""

    def __init__(self, argv: list[str], port: int, token: str, env: dict, log_path: Path, ready_path: str):
        self.argv, self.port, self.token, self.env = argv, port, token, env
        self.log_path, self.ready_path = Path(log_path), ready_path
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str = "") -> str:
        path = path.lstrip("/")
        if not self.token:
            return f"{self.base}/{path}"
        sep = "&" if "?" in path else "?"
        return f"{self.base}/{path}{sep}token={self.token}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # Own process group: stop() ends the server and the kernels it started, nothing else.
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.argv[2:4]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url(self.ready_path), timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"no answer on {self.base}/{self.ready_path} within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the group we created for it (start_new_session)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def _root_flag() -> list[str]:
    # CI containers run as root; Jupyter refuses that without the flag.
    return ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []


def _start_with_retries(make: Callable[[int], Server], attempts: int, timeout: float) -> Server:
    errors = []
    for _ in range(attempts):
        server = make(free_port())
        try:
            return server.start(timeout)
        except ServerError as e:  # port race, slow start: try again on a fresh port
            server.stop()
            errors.append(str(e))
    raise ServerError(f"server did not start in {attempts} attempts:\n" + "\n---\n".join(errors))


def start_lab(root_dir: Path, workdir: Path, *, attempts: int = 3, timeout: float = 90) -> Server:
    """JupyterLab serving ``root_dir`` on 127.0.0.1 (free port, random token, no browser).

    ``window.jupyterapp`` is exposed so tests can run Lab commands directly.
    """
    env = isolated_jupyter_env(workdir)
    token = secrets.token_hex(16)

    def make(port: int) -> Server:
        argv = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            "--port-retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root_dir}",
            "--ServerApp.open_browser=False",
            "--ServerApp.terminals_enabled=False",
            "--LabApp.expose_app_in_browser=True",
            f"--LabApp.user_settings_dir={Path(workdir) / 'settings'}",
            f"--LabApp.workspaces_dir={Path(workdir) / 'workspaces'}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ] + _root_flag()
        return Server(argv, port, token, env, Path(workdir) / f"lab-{port}.log", "api/status")

    return _start_with_retries(make, attempts, timeout)


def start_voila(notebook: Path, workdir: Path, *, attempts: int = 3, timeout: float = 90) -> Server:
    """Voila serving one notebook as an app (code cells hidden) at ``server.url()``."""
    env = isolated_jupyter_env(workdir)
    notebook = Path(notebook)

    def make(port: int) -> Server:
        argv = [
            sys.executable,
            "-m",
            "voila",
            str(notebook),
            "--no-browser",
            "--Voila.ip=127.0.0.1",
            f"--port={port}",
            "--Voila.port_retries=0",
            f"--Voila.root_dir={notebook.parent}",
            "--show_tracebacks=True",
        ]  # standalone Voila neither refuses root nor knows --allow-root
        # Readiness: a static file, so the check does not start a kernel as "/" would.
        return Server(argv, port, "", env, Path(workdir) / f"voila-{port}.log", "voila/static/voila.js")

    return _start_with_retries(make, attempts, timeout)


# --------------------------------------------------------------------------- browser


def launch_chromium(playwright, **kwargs):
    """Debian's chromium through Playwright (``playwright install`` cannot download here).

    ``launch`` gives every browser a fresh temporary profile (user-data-dir).
    """
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, **kwargs)


# --------------------------------------------------------------------------- Lab pages


def open_notebook(page, server: Server, name: str, *, timeout: float = 90) -> None:
    """Open ``name`` (relative to the server root) in Lab and wait until its kernel is idle."""
    page.goto(server.url(f"lab/tree/{name}"), wait_until="domcontentloaded", timeout=timeout * 1000)
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=timeout * 1000)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(state="visible", timeout=timeout * 1000)
    wait_kernel_idle(page, timeout=timeout)


_KERNEL_STATUS_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return k ? k.status : null;
}"""


def kernel_status(page) -> str | None:
    return page.evaluate(_KERNEL_STATUS_JS)


def wait_kernel_idle(page, *, timeout: float = 90) -> None:
    page.wait_for_function(
        "() => { const s = (" + _KERNEL_STATUS_JS + ")(); return s === 'idle'; }", timeout=timeout * 1000
    )


def run_all(page, *, via: str = "menu", timeout: float = 180) -> None:
    """Run all cells and wait until every code cell has an execution count and the kernel is idle.

    ``via="menu"`` clicks Run > Run All Cells as a user would; ``via="command"`` runs the Lab
    command ``notebook:run-all-cells`` directly.
    """
    if via == "menu":
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    elif via == "command":
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    else:
        raise ValueError(via)
    # Every code cell's prompt reads "[n]:" (not "[ ]:" or "[*]:").
    page.wait_for_function(
        """() => {
          const prompts = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt')];
          return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }""",
        timeout=timeout * 1000,
    )
    wait_kernel_idle(page, timeout=timeout)


def cell_errors(page) -> list[str]:
    """Texts of error outputs (tracebacks) shown in the current notebook."""
    return page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]').all_inner_texts()


def assert_no_cell_errors(page) -> None:
    errors = cell_errors(page)
    assert not errors, "cells raised:\n" + "\n---\n".join(e[-2000:] for e in errors)


# --------------------------------------------------------------------------- widgets (Lab and Voila)


def widget_checkbox(page, description: str | re.Pattern):
    """The <input> of the ipywidgets Checkbox whose description matches."""
    return page.locator(".widget-checkbox", has_text=description).locator("input[type=checkbox]").first


def wait_for_text(locator, expected: str | re.Pattern | Callable[[str], bool], *, timeout: float = 60) -> str:
    """Poll ``locator``'s text until it equals/matches ``expected``; return the text."""
    if callable(expected) and not isinstance(expected, re.Pattern):
        ok = expected
    elif isinstance(expected, re.Pattern):
        ok = lambda t: expected.search(t) is not None  # noqa: E731
    else:
        ok = lambda t: t.strip() == expected.strip()  # noqa: E731
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = locator.inner_text(timeout=2000)
            if ok(last):
                return last
        except Exception:  # not attached yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"text never matched {expected!r} within {timeout}s; last seen: {last!r}")


def wait_for_text_change(locator, before: str, *, timeout: float = 60) -> str:
    return wait_for_text(locator, lambda t: t != before, timeout=timeout)


def bokeh_canvas(scope):
    """The first drawn canvas of a Bokeh figure inside ``scope`` (page or locator).

    BokehJS renders into open shadow roots; Playwright's CSS locators pierce them.
    """
    return scope.locator(".bk-Canvas canvas").first


def canvas_ink(locator, rgb: tuple[int, int, int] = (0x1F, 0x77, 0xB4), tol: int = 12) -> int:
    """Number of canvas pixels of colour ``rgb`` (default: Bokeh's first palette colour)."""
    return locator.evaluate(
        """(c, [r, g, b, tol]) => {
          const ctx = c.getContext('2d');
          if (!ctx || c.width === 0 || c.height === 0) return 0;
          const d = ctx.getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4)
            if (d[i+3] > 0 && Math.abs(d[i] - r) <= tol && Math.abs(d[i+1] - g) <= tol && Math.abs(d[i+2] - b) <= tol) n++;
          return n;
        }""",
        [*rgb, tol],
    )


def bokeh_source_data(page, column: str) -> list | None:
    """Browser-side values of ``column`` in the first ColumnDataSource that has it."""
    return page.evaluate(
        """col => {
          const B = window.Bokeh;
          if (!B) return null;
          for (const doc of B.documents || []) {
            for (const m of doc.all_models) {
              if (m.data && m.data instanceof Map ? m.data.has(col) : (m.data && col in m.data)) {
                const v = m.data instanceof Map ? m.data.get(col) : m.data[col];
                return Array.from(v);
              }
            }
          }
          return null;
        }""",
        column,
    )


def screenshot(page, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path


def chromium_missing_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not found (install Debian's chromium: apt-get install -y chromium, or run bash scripts/test.sh)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright (Python client) is not installed; pip install -e '.[test]'"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def iter_texts(locators: Iterable) -> list[str]:
    return [loc.inner_text() for loc in locators]
