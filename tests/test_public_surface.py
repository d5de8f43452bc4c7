"""The public surface is deliberate: about 25 names at the top level, the rest in documented
submodules (scripts/api_reference.py), and the course notebooks and the README use only those.
docs/api.md is generated from the surface's docstrings and must be current."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import api_reference  # noqa: E402

import memsave_nb  # noqa: E402

DOCUMENTED = {m.removeprefix("memsave_nb."): set(api_reference.documented_names(m)) for m in api_reference.SUBMODULES}


def _code_of(path: Path) -> list[str]:
    """Python the reader runs: a py:percent notebook whole, a Markdown file's python blocks."""
    text = path.read_text()
    if path.suffix == ".py":
        return [re.sub(r"^(%|!).*$", "", text, flags=re.M)]  # magics are not Python
    return re.findall(r"```(?:python|py)\n(.*?)```", text, re.S)


def outside_surface(code: str) -> list[str]:
    """Every use of memsave_nb in ``code`` that is neither a top-level name nor a documented one."""
    tree = ast.parse(re.sub(r"^\s*[%!].*$", "", code, flags=re.M))
    bad: list[str] = []
    aliases = {"memsave_nb"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "memsave_nb":
                    aliases.add(a.asname or a.name)
                elif a.name.startswith("memsave_nb.") and a.name.removeprefix("memsave_nb.") not in DOCUMENTED:
                    bad.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memsave_nb":
            sub = node.module.removeprefix("memsave_nb").removeprefix(".")
            for a in node.names:
                ok = (
                    (a.name in memsave_nb.__all__ or a.name in DOCUMENTED)
                    if not sub
                    else a.name in DOCUMENTED.get(sub, ())
                )
                if not ok:
                    bad.append(f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr not in memsave_nb.__all__ and node.attr not in DOCUMENTED:
                bad.append(f"memsave_nb.{node.attr}")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id in aliases
            and node.value.attr in DOCUMENTED
            and node.attr not in DOCUMENTED[node.value.attr]
        ):
            bad.append(f"memsave_nb.{node.value.attr}.{node.attr}")
    return bad


READERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.py")) + [ROOT / "README.md"]


@pytest.mark.parametrize("path", READERS, ids=lambda p: p.name)
def test_the_notebooks_and_readme_use_only_the_documented_surface(path):
    bad = [b for code in _code_of(path) for b in outside_surface(code)]
    assert bad == [], f"{path.name} uses names outside the surface (docs/api.md): {bad}"


def test_the_checker_flags_private_names_and_passes_the_surface():
    assert outside_surface("from memsave_nb import measure, Workload, zoo\nimport memsave_nb\nmemsave_nb.explore") == []
    assert outside_surface("from memsave_nb.ui.format import format_bytes\nmemsave_nb.trainers.lora_settings") == []
    assert outside_surface("from memsave_nb.measure.engine import _run") == [
        "from memsave_nb.measure.engine import _run"
    ]
    assert outside_surface("import memsave_nb as ms\nms.units") == ["memsave_nb.units"]
    assert outside_surface("from memsave_nb.plan import _private") == ["from memsave_nb.plan import _private"]


def test_the_top_level_is_about_25_names_and_each_resolves():
    assert 20 <= len(memsave_nb.__all__) <= 30
    assert len(set(memsave_nb.__all__)) == len(memsave_nb.__all__)
    for name in memsave_nb.__all__:
        assert getattr(memsave_nb, name) is not None


def test_every_documented_submodule_name_exists():
    missing = [
        f"{m}.{n}"
        for m in api_reference.SUBMODULES
        for n in api_reference.documented_names(m)
        if not hasattr(importlib.import_module(m), n)
    ]
    assert missing == []


def test_docs_api_md_is_generated_from_the_current_surface():
    assert (ROOT / "docs" / "api.md").read_text() == api_reference.render(), (
        "docs/api.md is stale: run python scripts/api_reference.py"
    )


def test_importing_the_package_loads_no_ui_planner_or_parallel_engine():
    """Measuring never pays for the explorer (ipywidgets, Bokeh), the planner or the ranks."""
    import subprocess

    code = (
        "import sys, memsave_nb; print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ipywidgets', 'bokeh') or m.startswith(('memsave_nb.ui', 'memsave_nb.planner', 'memsave_nb.parallel.'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
