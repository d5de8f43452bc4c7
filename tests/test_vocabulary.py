"""One vocabulary: every registered choice is accepted by every door that takes it (Workload, Plan,
the CLI, the magics), and the lists that used to be copied elsewhere are the registry's."""

from __future__ import annotations

import ast
import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from memsave_nb import vocabulary as V
from memsave_nb.checkpointing import POLICY_PRESETS
from memsave_nb.errors import PlanError, WorkloadError
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload

PACKAGE = Path(__file__).resolve().parents[1] / "memsave_nb"


def _workload(optimizer):
    return Workload(nn.Linear(4, 3), torch.randn(2, 4), optimizer=optimizer)


@pytest.mark.parametrize("name", list(V.OPTIMIZERS))
def test_every_optimizer_is_taken_by_workload_plan_cli_and_magics(name):
    from memsave_nb.cli.report import add_knob_arguments
    from memsave_nb.magics import OPTIMIZERS as MAGIC_OPTIMIZERS

    assert Plan(optimizer=name).optimizer == name
    p = argparse.ArgumentParser()
    add_knob_arguments(p)
    assert p.parse_args(["--optimizer", name]).optimizer == name
    assert name in MAGIC_OPTIMIZERS
    wl = _workload(name)
    try:
        opt = wl.make_optimizer()
    except WorkloadError as exc:  # adamw_8bit where bitsandbytes does not import
        pytest.skip(str(exc))
    assert isinstance(opt, torch.optim.Optimizer) or type(opt).__module__.startswith("bitsandbytes")


def test_the_two_old_disagreements_are_gone():
    # Workload used to refuse adafactor, Plan used to refuse adam
    assert isinstance(_workload("adafactor").make_optimizer(), torch.optim.Adafactor)
    assert Plan(optimizer="adam").optimizer == "adam"
    assert type(_workload("adam").make_optimizer()) is torch.optim.Adam
    assert type(_workload("sgd-nomomentum").make_optimizer()) is torch.optim.SGD  # old spelling
    assert _workload("none").make_optimizer() is None
    with pytest.raises(WorkloadError, match="unknown optimizer"):
        _workload("lamb")
    with pytest.raises(PlanError, match="optimizer"):
        Plan(optimizer="lamb")


def test_other_lists_are_the_registrys():
    from memsave_nb import knobs, loss, magics, parallel_spec
    from memsave_nb.cli import plan as cli_plan
    from memsave_nb.export import pipeline as export_pipeline
    from memsave_nb.planner import layout, search
    from memsave_nb.ui.editor import REGION_CHOICES

    assert knobs.PRECISIONS is V.PRECISIONS and cli_plan.PRECISIONS is V.PRECISIONS
    assert knobs.OPTIMIZERS is V.OPTIMIZERS and loss.LOSSES is V.LOSSES
    assert magics.OPTIMIZERS == (*V.OPTIMIZERS, "none")
    assert list(POLICY_PRESETS) == list(V.REGION_KINDS)
    assert [key for _, key in REGION_CHOICES if key != "custom"] == list(V.REGION_KINDS)
    assert search.REGION_KINDS == V.SEARCHED_REGION_KINDS
    assert set(layout.REGION_KINDS) - {None} <= set(V.SEARCHED_REGION_KINDS)
    assert parallel_spec.STRATEGIES == tuple(V.STRATEGIES)
    assert parallel_spec.SCHEDULES == tuple(V.SCHEDULES) and export_pipeline.SCHEDULES is V.SCHEDULES
    for name in V.PRECISIONS:
        assert Plan(precision=name).precision == name
    for name in V.LOSSES:
        assert Plan(loss=name).loss == name


def _literal_names(node):
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def test_no_module_but_the_registry_spells_out_a_choice_list():
    """A literal holding two or more of a registry's names outside vocabulary.py is a second copy
    (the export's code table and the trainers' translations map *from* the names: allowed)."""
    lists = {"optimizers": set(V.OPTIMIZERS), "precisions": set(V.PRECISIONS), "loops": set(V.LOOPS)}
    allowed = {"export/knobs.py", "trainers/hf.py", "trainers/accelerate.py", "planner/what_fits.py", "vocabulary.py"}
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names = _literal_names(node.value)
                copies += [f"{rel}:{node.lineno} {kind}" for kind, members in lists.items() if len(names & members) >= 3]
    assert not copies, copies


def test_the_registry_sits_at_the_bottom():
    """vocabulary.py imports nothing (but ``__future__``): any module may read it, no circle."""
    tree = ast.parse((PACKAGE / "vocabulary.py").read_text())
    imported = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [getattr(n, "module", None) for n in imported] == ["__future__"]
