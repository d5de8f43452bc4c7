"""Committed notebooks are valid, stripped of outputs, and carry kernelspec metadata.

Outputs in the repository bloat diffs and can teach stale numbers; a notebook without
``metadata.kernelspec`` stops JupyterLab (and the browser test) on a "select kernel" dialog.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def committed_notebooks() -> list[Path]:
    """notebooks/**/*.ipynb tracked by git (all of them on disk when git is unavailable)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "notebooks"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p.endswith(".ipynb")]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in NOTEBOOKS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts]
    return sorted(p for p in paths if p.exists())


def notebook_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What is wrong with a notebook for committing; empty when it is fine."""
    problems = []
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        problems.append(f"invalid nbformat: {e.message}")
    ks = nb.metadata.get("kernelspec") or {}
    if not ks.get("name") or not ks.get("display_name"):
        problems.append("metadata.kernelspec with name and display_name is missing (Lab would ask for a kernel)")
    if "widgets" in nb.metadata:
        problems.append("metadata.widgets holds saved widget state (an output in disguise)")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i} has {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i} has execution_count {cell.execution_count}")
    return problems


@pytest.mark.parametrize(
    "path", committed_notebooks() or [pytest.param(None, id="no-notebooks-yet")], ids=lambda p: getattr(p, "name", p)
)
def test_committed_notebook_is_stripped(path):
    if path is None:
        assert committed_notebooks() == []
        return
    nb = nbformat.read(str(path), as_version=4)
    problems = notebook_problems(nb)
    assert not problems, (
        f"{path.relative_to(ROOT)}:\n  "
        + "\n  ".join(problems)
        + ("\nStrip it: jupyter nbconvert --clear-output --inplace, and keep its kernelspec")
    )


# The checker itself, so this file asserts something real before the course exists.


def _good() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("1 + 1")]
    return nb


def test_checker_accepts_clean_notebook(tmp_path):
    p = tmp_path / "ok.ipynb"
    nbformat.write(_good(), str(p))
    assert notebook_problems(nbformat.read(str(p), as_version=4)) == []


def test_checker_flags_outputs_counts_widgets_and_missing_kernelspec():
    nb = _good()
    nb.cells[1].outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "2"}, execution_count=1)]
    nb.cells[1].execution_count = 1
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    del nb.metadata["kernelspec"]
    problems = "\n".join(notebook_problems(nb))
    for needle in ("output", "execution_count", "metadata.widgets", "kernelspec"):
        assert needle in problems, (needle, problems)


def test_checker_flags_invalid_notebook():
    nb = _good()
    nb.cells[1]["bogus"] = 1
    assert any("invalid" in p for p in notebook_problems(nb))


def _sync_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "scripts" / "sync_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_notebook_is_written_from_its_text_source():
    """The course is authored as py:percent files: each committed .ipynb equals what
    ``scripts/sync_notebooks.py`` writes from its ``.py``, and every notebook has a source."""
    pytest.importorskip("jupytext")
    sync = _sync_script()
    sources = sync.sources()
    assert sources, "notebooks/ holds no NN-*.py source"
    assert {p.stem for p in sources} == {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]-*.ipynb")}
    stale = [p.name for p in sources if p.with_suffix(".ipynb").read_text() != sync.build(p)]
    assert not stale, f"out of date (run python scripts/sync_notebooks.py): {stale}"


def test_sync_writes_cells_ids_and_kernelspec_from_a_percent_file(tmp_path):
    """A markdown and a hidden answer cell survive the trip with their metadata; ids are stable."""
    pytest.importorskip("jupytext")
    sync = _sync_script()
    src = tmp_path / "99-t.py"
    src.write_text(
        '# %% [markdown]\n# # Title\n\n# %%\nx = 1\n\n# %% tags=["answer"] jupyter={"source_hidden": true}\nprint(x)\n'
    )
    nb = nbformat.reads(sync.build(src), as_version=4)
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code"]
    assert [c.id for c in nb.cells] == ["cell-00", "cell-01", "cell-02"]
    assert nb.cells[0].source == "# Title" and nb.cells[1].source == "x = 1"
    assert nb.cells[2].metadata["tags"] == ["answer"] and nb.cells[2].metadata["jupyter"]["source_hidden"]
    assert notebook_problems(nb) == []
