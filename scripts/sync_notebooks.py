"""Write the course notebooks (``notebooks/NN-*.ipynb``) from their text sources (``notebooks/NN-*.py``).

The course is authored as jupytext py:percent files: each ``# %%`` starts a code cell and
``# %% [markdown]`` a text cell, so a change to the course is a plain, reviewable diff. The
committed ``.ipynb`` files are what readers, the notebook tests and Voila open; they are
generated from the ``.py`` files with outputs stripped, stable cell ids and a kernelspec (a
notebook without one stops JupyterLab on a "select kernel" dialog).

    python scripts/sync_notebooks.py            # rewrite every notebook from its source
    python scripts/sync_notebooks.py 05         # only those whose name contains "05"
    python scripts/sync_notebooks.py --check    # exit 1 when a notebook differs from its source

A new notebook: write ``notebooks/NN-title.py`` (copy the header of an existing one) and run
this script. Editing in JupyterLab: open the ``.ipynb``, then copy the change back with
``jupytext --to py:percent --opt notebook_metadata_filter=-all notebooks/NN-title.ipynb``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def sources() -> list[Path]:
    """The course's text sources, in course order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]-*.py"))


def build(source: Path) -> str:
    """The committed ``.ipynb`` text for one py:percent source."""
    nb = jupytext.read(source, fmt="py:percent")
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives the same file
        cell["id"] = f"cell-{i:02d}"
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    nb.nbformat, nb.nbformat_minor = 4, 5
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
    """Write every notebook (or only those named); ``--check`` fails when one differs on disk."""
    check = "--check" in argv
    wanted = [a for a in argv if not a.startswith("-")]
    stale = []
    for source in sources():
        if wanted and not any(w in source.name for w in wanted):
            continue
        text, path = build(source), source.with_suffix(".ipynb")
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
            continue
        path.write_text(text)
        print(f"wrote notebooks/{path.name}")
    if stale:
        print("out of date (run python scripts/sync_notebooks.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
