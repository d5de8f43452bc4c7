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
                copies += [
                    f"{rel}:{node.lineno} {kind}" for kind, members in lists.items() if len(names & members) >= 3
                ]
    assert not copies, copies


def test_the_registry_sits_at_the_bottom():
    """vocabulary.py imports nothing (but ``__future__``): any module may read it, no circle."""
    tree = ast.parse((PACKAGE / "vocabulary.py").read_text())
    imported = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [getattr(n, "module", None) for n in imported] == ["__future__"]


# -- one place each: a registered name without its branch fails here (docs/architecture.md, "Adding a new ...")


def test_the_layout_search_reads_its_region_kinds_from_the_registry():
    from memsave_nb.planner import layout

    assert layout.REGION_KINDS == (None, *(k for k in V.SEARCHED_REGION_KINDS if k != "offload"))
    assert all(k in POLICY_PRESETS and k in V.REGION_KINDS for k in layout.REGION_KINDS[1:])


def test_every_strategy_has_a_branch_of_its_own():
    """parallel/apply.py: a registered strategy with no branch falls into FSDP2's and sizes as FSDP2;
    each must size its own way (DDP: a whole replica of 2 x 64 x 64 weights; FSDP2: half of them)."""
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    torch.manual_seed(0)
    wl = Workload(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), torch.randn(4, 64))
    peaks = {
        s: measure_parallel(wl, ParallelSpec(world_size=2, strategy=s), ranks=[0]).rank(0).peak_bytes
        for s in V.STRATEGIES
    }
    assert len(set(peaks.values())) == len(V.STRATEGIES), peaks
    assert peaks["ddp"] > peaks["fsdp"]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_every_loss_but_the_models_own_has_a_branch():
    """loss.apply_loss: a registered loss with no branch would run the model's own loss unseen."""
    from memsave_nb.loss import apply_loss

    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    wl = Workload(model, batch)
    for name in V.LOSSES:
        undo = apply_loss(name, None, wl, batch)
        for u in reversed(undo):
            u()
        assert bool(undo) == (name != "full"), name
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__  # put back


def test_every_trainer_writes_and_reads_back_its_own_config():
    """trainers.TRAINERS: each module writes a plan's checkpointing, precision and FSDP2 and reads them back
    (accelerate's config holds checkpointing only under FSDP, so the plan has it)."""
    from memsave_nb.parallel_spec import ParallelSpec
    from memsave_nb.trainers import TRAINERS, from_trainer, to_trainer

    model = _tiny_llama()
    layers = {f"model.layers.{i}": "full" for i in range(2)}
    plan = Plan(precision="autocast_bf16", regions=layers, parallel=ParallelSpec(world_size=2))
    for name in TRAINERS:
        text = to_trainer(plan, name, model=model).text
        back = from_trainer(text, model, trainer=name, world_size=2)
        assert back.plan.regions == plan.regions and back.plan.precision == plan.precision, (name, text)
        assert back.plan.parallel is not None and back.plan.parallel.strategy == "fsdp", (name, text)


@pytest.mark.parametrize("name", list(V.OPTIMIZERS))
def test_every_optimizer_is_written_as_code(name):
    """export/knobs.py: a registered optimizer with no code line made Plan.to_code() raise KeyError
    (lion and lion_8bit did); the line builds the optimizer the knob sizes."""
    code = Plan(optimizer=name).to_code()
    line = next(x for x in code.splitlines() if x.startswith("optimizer = "))
    assert "(params" in line
    if "bitsandbytes." in line:
        assert "import bitsandbytes.optim" in code


def test_every_schedule_is_a_torch_pipelining_class():
    """parallel/pipeline.py builds a schedule by the class name the registry gives it."""
    import torch.distributed.pipelining as pipelining

    from memsave_nb.parallel.pipeline import _schedule_class

    for name, cls in V.SCHEDULES.items():
        assert _schedule_class(name) is getattr(pipelining, cls)
        assert issubclass(_schedule_class(name), pipelining.schedules._PipelineSchedule)
