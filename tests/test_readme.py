"""The README a newcomer reads: its quickstart runs and prints what it says, its links resolve,
and no doc points outside the repository (a clone has no ../shared)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_opens_with_a_quickstart_that_prints_the_peak_it_states():
    first = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert README.index(first) < 400, "the quickstart is not the first thing a reader sees"
    stated = re.search(r"# (\d+) (\w+) \{", first)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(first, "README quickstart", "exec"), {})
    peak, phase = out.getvalue().split()[:2]
    assert (peak, phase) == stated.groups()


def test_the_readme_is_short_and_keeps_the_two_commands():
    assert len(README.splitlines()) <= 170
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh", "bash scripts/test.sh --fast"):
        assert command in README


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.name}: {target}")
    assert broken == []


def test_no_doc_points_outside_the_repository():
    docs = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))} | {"README.md": README}
    outside = [name for name, text in docs.items() if name != "architecture.md" and "../shared/" in text]
    assert outside == []
