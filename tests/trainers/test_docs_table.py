"""``docs/trainers.md``'s table of the fields that change memory is read as data: every test it
names exists, every field the readers size has a row, and the optimizer count it quotes is the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from memsave_nb.trainers import fields, hf

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Every field that changes memory, how it is sized, and the test that checks it"


def _rows() -> list[list[str]]:
    text = (ROOT / "docs" / "trainers.md").read_text()
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| field")
    ]
    assert rows and all(len(r) == 3 for r in rows), rows
    return rows


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_test_the_table_names_exists():
    named = [ref for _, _, tests in _rows() for ref in re.findall(r"`(test_\w+\.py)::(test_\w+)`", tests)]
    assert len(named) >= 20
    for file, test in named:
        path = ROOT / "tests" / "trainers" / file
        assert path.exists(), file
        assert test in _tests_in(path), f"{file}::{test}"
    assert all(re.search(r"`test_\w+\.py::test_\w+`", tests) for _, _, tests in _rows())  # every row names one


def test_every_sized_field_has_a_row_and_the_optim_count_is_the_codes():
    listed = {name for field, _, _ in _rows() for name in re.findall(r"`([a-z_0-9]+)`", field)}
    assert fields.SIZED <= listed, sorted(fields.SIZED - listed)
    optim_row = next(sized for field, sized, _ in _rows() if field == "`optim`")
    assert optim_row.startswith(f"{len(hf.OPTIM)} of the {len(hf.optim_names() or ())} `OptimizerNames`")
