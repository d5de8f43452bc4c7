"""binder/ alone gives every course notebook what it imports, and builds an env that runs one.

Binder cannot be reached from these machines, so two checks stand in for it:

- every top-level package a notebook's code cells import is the standard library, the project,
  or a distribution listed in ``binder/requirements.txt`` (a notebook that imports
  ``transformers`` fails on Binder otherwise);
- a fresh venv built the way repo2docker builds one (``pip install -r binder/requirements.txt``,
  then ``binder/postBuild`` from the repository root) executes notebook 08. The only change to
  the requirements is the PyTorch CPU index line, which this machine cannot reach: the
  ``torch==2.13.0`` pin beside it resolves to the local CPU wheel instead (slow: minutes;
  the wheels are kept under ``~/.cache/memsave_nb/binder-wheels`` for later runs).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
PROJECT = "memsave_nb"

# Import names whose distribution is named otherwise and may be absent from the test env
# (importlib.metadata answers for what is installed).
DIST_OF_IMPORT = {"IPython": "ipython", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def _norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def code_imports(source: str) -> set[str]:
    """Top-level packages one code cell imports (magics and shell lines skipped; relative imports too)."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    names = set()
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def notebook_imports(path: Path) -> set[str]:
    nb = nbformat.read(str(path), as_version=4)
    return set().union(*(code_imports(c.source) for c in nb.cells if c.cell_type == "code"))


def required_distributions(text: str) -> set[str]:
    """Normalised distribution names in a requirements file (options and comments skipped)."""
    out = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            out.add(_norm(re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0]))
    return out


def distribution_of(module: str) -> str:
    """The distribution that provides an import name: the known map, then the installed env, then itself."""
    if module in DIST_OF_IMPORT:
        return _norm(DIST_OF_IMPORT[module])
    dists = importlib.metadata.packages_distributions().get(module)
    return _norm(dists[0] if dists else module)


def missing_from_binder(imports: set[str], requirements: set[str]) -> set[str]:
    """Imports neither stdlib, the project, nor provided by a listed distribution."""
    return {
        m
        for m in imports
        if m not in sys.stdlib_module_names and m != PROJECT and distribution_of(m) not in requirements
    }


def test_binder_requirements_cover_every_notebook_import():
    assert NOTEBOOKS, "no course notebook found"
    requirements = required_distributions((BINDER / "requirements.txt").read_text())
    problems = {
        p.name: sorted(missing)
        for p in NOTEBOOKS
        if (missing := missing_from_binder(notebook_imports(p), requirements))
    }
    assert not problems, f"binder/requirements.txt lacks what these notebooks import: {problems}"


def _specifiers(lines) -> dict[str, str]:
    """{normalised name: specifier} of requirement lines (options and comments skipped)."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", line).groups()
            out[_norm(name)] = spec.replace(" ", "")
    return out


def test_binder_pins_match_the_development_setup():
    """Binder gets the torch scripts/setup.sh pins and pyproject.toml's specifiers for the rest."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    binder = _specifiers((BINDER / "requirements.txt").read_text().splitlines())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = _specifiers(project["dependencies"] + project["optional-dependencies"]["test"])
    (torch_pin,) = re.findall(r'^TORCH_PIN="(.+)"', (ROOT / "scripts" / "setup.sh").read_text(), re.M)
    dev.update(_specifiers([torch_pin]))
    differ = {name: (spec, dev.get(name)) for name, spec in binder.items() if dev.get(name) != spec}
    assert not differ, f"binder/requirements.txt vs the development set-up (binder, dev): {differ}"


def test_import_collector_sees_nested_and_aliased_imports_and_skips_magics():
    src = "import os.path as p\nif True:\n    from yaml import safe_load\n%time import nothing\nfrom . import rel\n"
    assert code_imports(src) == {"os", "yaml"}
    assert missing_from_binder({"os", "yaml", "IPython", PROJECT}, {"ipython"}) == {"yaml"}
    assert required_distributions("--extra-index-url x\ntorch==2.13.0  # cpu\nJupyter_Bokeh>=4\n") == {
        "torch",
        "jupyter-bokeh",
    }


# --------------------------------------------------------------------------- a repo2docker-like build

TORCH_INDEX = "download.pytorch.org"


def _local_requirements(text: str) -> str:
    """binder/requirements.txt without the PyTorch index line (unreachable here); the pin stays."""
    kept = [ln for ln in text.splitlines() if TORCH_INDEX not in ln]
    assert len(kept) == len(text.splitlines()) - 1, "expected exactly one PyTorch CPU index line"
    return "\n".join(kept) + "\n"


def _copy_checkout(dest: Path) -> None:
    """The repository's files as repo2docker copies them into the image (no venv, no build outputs)."""
    ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "artifacts", ".pytest_cache", "build")
    shutil.copytree(ROOT, dest, ignore=ignore)


def _wheelhouse() -> Path:
    """Wheels kept between runs of the build test (under the user's cache directory)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "memsave_nb" / "binder-wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clean_env(venv: Path, home: Path) -> dict[str, str]:
    """The build's environment: the venv first on PATH, nothing of the test run's Python or Jupyter."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "VIRTUAL_ENV", "CONDA", "BOKEH"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    for sub in ("data", "config", "runtime"):
        env[f"JUPYTER_{sub.upper()}_DIR"] = str(home / sub)
    return env


def _run(argv: list[str], log: Path, **kw) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, argv))}\n")
        f.flush()
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        pytest.fail(f"{' '.join(map(str, argv[:4]))} ... exited {rc}:\n{tail}", pytrace=False)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_binder_env_alone_executes_notebook_08(tmp_path):
    runtime = (BINDER / "runtime.txt").read_text().strip()
    if runtime != f"python-{sys.version_info.major}.{sys.version_info.minor}":
        pytest.skip(f"binder/runtime.txt asks for {runtime}; this interpreter is {sys.version.split()[0]}")
    repo, venv, log = tmp_path / "repo", tmp_path / "venv", tmp_path / "build.log"
    _copy_checkout(repo)
    env = _clean_env(venv, tmp_path / "jupyter")
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", str(venv)], log, env=env)
    req = tmp_path / "requirements.txt"
    req.write_text(_local_requirements((BINDER / "requirements.txt").read_text()))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    # pip's own cache stays empty here (the index answers uncacheable), so keep the wheels between
    # runs: download what is missing, then install from them alone
    wheels = _wheelhouse()
    _run([*pip, "download", "-q", "--progress-bar", "off", "-d", str(wheels), "-r", str(req)], log, env=env, cwd=repo)
    _run(
        [*pip, "install", "-q", "--progress-bar", "off", "--no-index", "--find-links", str(wheels), "-r", str(req)],
        log,
        env=env,
        cwd=repo,
    )
    _run(["bash", str(repo / "binder" / "postBuild")], log, env=env, cwd=repo)

    # The project comes from the copy, not from the checkout under test or the dev venv.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", f"import {PROJECT}; print({PROJECT}.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where.strip()).is_relative_to(repo), where

    (nb_path,) = [p for p in NOTEBOOKS if p.name.startswith("08-")]
    out = tmp_path / "executed.ipynb"
    _run(
        [
            str(venv / "bin" / "jupyter"),
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            "--ExecutePreprocessor.timeout=600",
            "--ExecutePreprocessor.kernel_name=python3",
            f"--output={out}",
            str(repo / "notebooks" / nb_path.name),
        ],
        log,
        env=env,
        cwd=repo / "notebooks",
    )
    executed = nbformat.read(str(out), as_version=4)
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert all(c.get("execution_count") for c in executed.cells if c.cell_type == "code" and c.source.strip())
