"""Every course notebook runs top to bottom without a cell error, in under 3 minutes.

Each notebook's last cell asserts its key claim from measured numbers, so an engine regression
fails here instead of silently teaching a wrong figure. The kernel is the Python running the
tests (the project's venv): a ``python3`` kernelspec pointing at ``sys.executable`` is written
to a private Jupyter data dir that comes first on the path, whatever else is installed.

Run only these: ``pytest -m notebooks``; one notebook: ``pytest tests/test_notebooks.py -k 01``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
BUDGET_S = 180  # per notebook, on a 2-core CPU

pytestmark = [pytest.mark.notebooks, pytest.mark.slow]


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """JUPYTER_PATH with a python3 kernelspec for this interpreter; inline BokehJS (offline)."""
    data = tmp_path_factory.mktemp("jupyter-data")
    kdir = data / "kernels" / "python3"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (memsave_nb tests)",
                "language": "python",
            }
        )
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(data))
    mp.setenv("BOKEH_RESOURCES", "inline")
    mp.setenv("PYTHONUNBUFFERED", "1")
    yield data
    mp.undo()


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                out.append(f"cell {i}: {o.get('ename')}: {o.get('evalue')}")
    return out


@pytest.mark.timeout(BUDGET_S + 120)  # a hard stop; the budget itself is asserted below
@pytest.mark.parametrize(
    "path", NOTEBOOKS or [pytest.param(None, id="no-notebooks")], ids=lambda p: getattr(p, "stem", p)
)
def test_notebook_runs(path, kernel_env):
    if path is None:
        pytest.skip("notebooks/ holds no course notebook yet")
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(str(path), as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=BUDGET_S,  # per cell; the whole notebook is held to BUDGET_S below
        startup_timeout=120,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as exc:
        pytest.fail(f"{path.name}: a cell raised:\n{str(exc)[-3000:]}", pytrace=False)
    seconds = time.perf_counter() - start
    print(f"{path.name}: {seconds:.1f} s")
    assert not _errors(nb), _errors(nb)
    assert seconds < BUDGET_S, f"{path.name} took {seconds:.0f} s (budget {BUDGET_S} s on this 2-core CPU)"
