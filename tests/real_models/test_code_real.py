"""``Plan.to_code()``'s snippet, run on a fresh copy of a real model, reproduces the plan's bytes."""

from __future__ import annotations

from memsave_nb import presets
from memsave_nb.checkpointing import suggest_regions
from memsave_nb.measure import measure
from memsave_nb.plan import Plan


def _plans(model):
    blocks = suggest_regions(model)
    sac = {b: "save_matmuls" for b in blocks}
    last = presets.last_quarter(model)
    return [
        Plan(regions=sac),
        Plan(frozen=last.frozen, trainable=last.trainable, regions={**sac, blocks[0]: "full"}),
    ]


def test_exported_code_reproduces_the_plans_bytes(case):
    for plan in _plans(case.model):
        with plan.apply(case.workload) as applied:
            expected = measure(applied, "real", repeats=0, flops=False)
        fresh = case.fresh()  # same seed, same weights, KV cache on as built
        namespace = {"net": fresh.model}
        exec(compile(plan.to_code(model_var="net"), "<plan>", "exec", dont_inherit=True), namespace)
        assert not any(getattr(c, "use_cache", False) for c in _configs(fresh.model))
        got = measure(fresh.replace(model=namespace["net"]), "real", repeats=0, flops=False)
        assert got.saved_bytes == expected.saved_bytes, plan.describe()
        assert got.peak_bytes == expected.peak_bytes, plan.describe()
        trainable = [n for n, p in fresh.model.named_parameters() if p.requires_grad]
        assert trainable == plan.trainable_parameter_names(case.model)


def _configs(model):
    return [m.__dict__["config"] for m in model.modules() if hasattr(m.__dict__.get("config"), "use_cache")]
