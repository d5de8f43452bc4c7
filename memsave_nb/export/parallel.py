"""``Plan.to_code`` lines for a ``ParallelSpec``: the ``fully_shard`` / DDP / tensor-parallel calls
for a training script launched with ``torchrun --nproc-per-node N`` (``init_device_mesh`` starts the
process group from torchrun's environment when none exists); pipeline stages in ``pipeline.py``."""

from __future__ import annotations

import inspect

from memsave_nb.parallel_spec import ParallelSpec


def parallel_code(spec: ParallelSpec, model_var: str = "model") -> tuple[list[str], list[str]]:
    """``(imports, body)`` lines applying ``spec`` (no pipeline stages: ``pipeline.pipeline_code``)
    to ``model_var``."""
    m = model_var
    imports = ["import torch", "from torch.distributed.device_mesh import init_device_mesh"]
    body = [
        "",
        f"# {spec.describe()}: launch with torchrun --nproc-per-node {spec.world_size} (or across nodes)",
        'device_type = "cuda" if torch.cuda.is_available() else "cpu"',
    ]
    if spec.strategy == "ddp":
        imports.append("from torch.nn.parallel import DistributedDataParallel")
        body += [
            f"mesh = init_device_mesh(device_type, ({spec.world_size},))",
            f"{m} = DistributedDataParallel({m}, bucket_cap_mb={spec.bucket_cap_mb!r}, "
            f"gradient_as_bucket_view={spec.gradient_as_bucket_view!r}, process_group=mesh.get_group())",
        ]
        return imports, body
    body.append(f"mesh = init_device_mesh(device_type, {spec.mesh_shape!r}, mesh_dim_names={spec.mesh_dim_names!r})")
    more_imports, defs, calls = shard_code(spec, m, "mesh")
    return imports + more_imports, body + defs + calls


def shard_code(spec: ParallelSpec, m: str, mesh: str) -> tuple[list[str], list[str], list[str]]:
    """``(imports, definitions, calls)``: TP on ``mesh['tp']``, then ``fully_shard`` over the rest of
    ``mesh`` (a variable of the generated code), on module ``m``, as ``parallel/apply.py`` does."""
    imports = ["from torch.distributed.fsdp import fully_shard"]
    defs: list[str] = []
    calls: list[str] = []
    dp_mesh = mesh
    if spec.tensor_parallel > 1:
        more_imports, more_defs, more_calls = tensor_parallel_code(spec, m, mesh)
        imports += more_imports
        defs += more_defs
        calls += more_calls
        if spec.data_parallel == 1:
            return imports, defs, calls + ["# build the optimizer after this line, over the (now split) parameters"]
        dp_names = spec.mesh_dim_names[:-1]
        dp_mesh = f"{mesh}[{dp_names[0] if len(dp_names) == 1 else dp_names!r}]"
    kwargs = [f"mesh={dp_mesh}", f"reshard_after_forward={spec.reshard_after_forward!r}"]
    if spec.param_dtype or spec.reduce_dtype:
        imports.append("from torch.distributed.fsdp import MixedPrecisionPolicy")
        pd = f"torch.{spec.param_dtype}" if spec.param_dtype else "None"
        rd = f"torch.{spec.reduce_dtype}" if spec.reduce_dtype else "None"
        kwargs.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={pd}, reduce_dtype={rd})")
    if spec.cpu_offload:
        imports.append("from torch.distributed.fsdp import CPUOffloadPolicy")
        # pinned host memory makes the copies asynchronous; it needs the CUDA runtime
        kwargs.append("offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available())")
    calls.append(f"fsdp_kwargs = dict({', '.join(kwargs)})")
    if spec.shard_modules:
        calls.append(f"shard_units = {[n for n in spec.shard_modules if n]!r}")
    else:
        from memsave_nb.checkpointing import suggest_regions

        imports.append("from torch import nn")
        source = inspect.getsource(suggest_regions).splitlines()
        source[0] = "def suggest_regions(model):"
        defs += ["", *source, "", ""]
        calls.append(f"shard_units = suggest_regions({m})  # the repeated blocks")
    calls += [
        "for name in shard_units:  # each unit gathers its parameters only while it runs",
        f"    fully_shard({m}.get_submodule(name), **fsdp_kwargs)",
        f"fully_shard({m}, **dict(fsdp_kwargs, reshard_after_forward={spec.reshard_root!r}))  # the root: everything "
        + (
            "not in a unit, resharded after forward (as accelerate does)"
            if spec.reshard_root
            else "not in a unit, kept gathered after forward (torch's default for the root)"
        ),
        "# build the optimizer after this line, over the (now sharded) parameters",
    ]
    return imports, defs, calls


def _source(fn, signature: str) -> list[str]:
    lines = inspect.getsource(fn).splitlines()
    return [signature, *lines[1:]]


def tensor_parallel_code(
    spec: ParallelSpec, model_var: str = "model", mesh: str = "mesh"
) -> tuple[list[str], list[str], list[str]]:
    """``parallelize_module`` with the spec's plan on ``mesh["tp"]``: the very functions the sizing
    resolves the plan and builds PyTorch's styles with, so the script splits what was measured."""
    from memsave_nb import tp_plan as tp

    m = model_var
    imports = ["from torch import nn", "from torch.distributed.tensor.parallel import parallelize_module"]
    body = [""]
    if spec.tp_plan:
        imports.append("import fnmatch")
        body += _source(tp.matched_tp_plan, "def matched_tp_plan(model, rules):") + ["", ""]
        plan = f"matched_tp_plan({m}, {[list(p) for p in spec.tp_plan]!r})"
    else:
        for const in ("COLWISE", "ROWWISE", "EMBEDDINGS", "HEADS", "POSITIONS"):
            body.append(f"{const} = {sorted(getattr(tp, const))!r}")
        body += ["", "", *_source(tp.default_tp_plan, "def default_tp_plan(model, sequence_parallel=False):"), "", ""]
        body += [*_source(tp._takes_hidden_states, "def _takes_hidden_states(module):"), "", ""]
        plan = f"default_tp_plan({m}, {spec.sequence_parallel!r})"
    body += [*_source(tp.tp_styles, "def tp_styles(plan, sequence_parallel):"), "", ""]
    calls = [
        f"tp_plan = {plan}  # (module name, style): Megatron-style column / row splits",
        f"parallelize_module({m}, {mesh}['tp'], tp_styles(tp_plan, {spec.sequence_parallel!r}))",
    ]
    return imports, body, calls
