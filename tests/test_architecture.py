"""The package's import rules, read from the source with ``ast`` (nothing is imported).

Imports only point down (docs/architecture.md, whose picture these rules are): no circle
between files; the plan's room (plan, restore, knobs, loss, hf, checkpointing, offload, naming, parallel_spec,
tp_plan, export/) knows nothing of parallel/, planner/, ui/ or cli/; measure/ imports nothing above it;
only the front doors parse arguments or build zoo models. A file over 600 lines is a warning
sign (cut it by job), not a failure: the linter and type checker (tests/test_tooling.py) are the gate."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memsave_nb"
MAX_LINES = 600
LONG_FILES_ALLOWED = {"layers/_native.c"}

# The plan's room: what a plan is and how it changes a model.
PLAN_ROOM = {"plan", "restore", "knobs", "loss", "hf", "checkpointing", "offload", "naming", "parallel_spec", "tp_plan"}
PLAN_ROOM_PACKAGES = ("export",)
ABOVE_PLAN = ("parallel", "planner", "ui", "cli")
# measure/ stands on these only (besides itself and the standard library / torch).
MEASURE_MAY_IMPORT = {"errors", "workload", "model_state", "layers"}
# Front doors: they may parse arguments and build the zoo's demo workloads.
FRONT_DOORS = ("cli", "magics", "__init__")
ZOO_ALLOWED = {"ui.explorer", "ui.by_name"}  # the explorer's demo names


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(mod: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute dotted name (inside the package, without ``memsave_nb.``) an import refers to."""
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    if path.name == "__init__.py" and mod == "__init__":
        base = []
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(mod: str, path: Path, known: set[str]) -> set[str]:
    """Every name this file imports (module level or inside functions): package modules as
    dotted names without the prefix, outside modules by their top-level name."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_inside(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, path, node)
            if node.level == 0 and not target.startswith("memsave_nb"):
                out.add(target.split(".")[0])
                continue
            target = target.removeprefix("memsave_nb").lstrip(".")
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.add(sub if sub in known else (target or "__init__"))
    out.discard(mod)
    return out


def _inside(name: str, known: set[str]) -> str:
    if name == "memsave_nb" or name.startswith("memsave_nb."):
        inner = name.removeprefix("memsave_nb").lstrip(".") or "__init__"
        while inner not in known and "." in inner:
            inner = inner.rsplit(".", 1)[0]
        return inner
    return name.split(".")[0]


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {i for i in imports_of(m, p, known) if i in known} for m, p in mods.items()}


def all_imports() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def _room(mod: str) -> str:
    return mod.split(".")[0]


def test_no_import_circle_between_files():
    """A circle is any strongly connected set of files (Tarjan), a package's ``__init__``
    included; imports inside functions and under ``TYPE_CHECKING`` count too."""
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles between files: {circles}"


def test_the_plan_room_knows_nothing_above_it():
    bad = {
        m: sorted(i for i in deps if _room(i) in ABOVE_PLAN)
        for m, deps in graph().items()
        if m in PLAN_ROOM or _room(m) in PLAN_ROOM_PACKAGES
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_measure_imports_nothing_above_it():
    bad = {
        m: sorted(i for i in deps if _room(i) != "measure" and _room(i) not in MEASURE_MAY_IMPORT)
        for m, deps in graph().items()
        if _room(m) == "measure"
    }
    assert {m: d for m, d in bad.items() if d} == {}


# The new rooms of turn 3: models by name return a Workload and know nothing of plans or views;
# trainers read and write configs as plans and know nothing of views or commands.
ROOM_MAY_NOT_IMPORT = {
    "hub": (
        "plan",
        "knobs",
        "checkpointing",
        "offload",
        "export",
        "parallel",
        "planner",
        "ui",
        "cli",
        "trainers",
        "session",
    ),
    "trainers": ("parallel", "planner", "ui", "cli", "session", "hub"),
}


def test_the_new_rooms_point_down():
    bad = {
        m: sorted(i for i in deps if _room(i) in ROOM_MAY_NOT_IMPORT[_room(m)])
        for m, deps in graph().items()
        if _room(m) in ROOM_MAY_NOT_IMPORT
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_only_front_doors_parse_arguments_or_build_zoo_models():
    bad = {}
    for m, deps in all_imports().items():
        if _room(m) in FRONT_DOORS:
            continue
        wrong = sorted(d for d in deps if d == "argparse" or (d == "zoo" and m not in ZOO_ALLOWED))
        if wrong:
            bad[m] = wrong
    assert bad == {}


def test_a_file_over_600_lines_is_a_warning_sign():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*"))
        if p.suffix in (".py", ".c", ".js", ".css")
        and str(p.relative_to(PACKAGE)) not in LONG_FILES_ALLOWED
        and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    if long:
        warnings.warn(f"files over {MAX_LINES} lines (cut them by job): {long}", stacklevel=1)


def test_the_reader_sees_module_level_and_function_level_imports():
    """The rules above are only as good as the reader: it must see a lazy import inside a
    method (``Plan.to_code``), a relative one, and an outside module by its top-level name."""
    g = graph()
    assert "export.pytorch" in g["plan"]  # inside Plan.to_code
    assert {"measure.step", "measure.summary", "measure.common"} <= g["measure.engine"]
    assert "argparse" in all_imports()["cli.args"]
    assert "zoo" in all_imports()["cli.report"]


def test_every_module_imports():
    """A moved module leaves no dangling import behind (a merge once left six to a file that had moved)."""
    import importlib
    import pkgutil

    import memsave_nb

    failures = []
    for info in pkgutil.walk_packages(memsave_nb.__path__, prefix="memsave_nb."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - collect them all, then fail once
            failures.append(f"{info.name}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
