"""``Plan.to_code`` lines for a ``ParallelSpec`` with pipeline stages: the device mesh (``pp``
outermost), this rank's stage module(s) split as ``measure_pipeline`` splits them, TP / FSDP2 on
the stage's sub-mesh, torch's ``PipelineStage`` and schedule, and the step.

The split is the one line that imports memsave_nb (``split_stages``): ``to_code`` sees the plan,
not the model, so it cannot write one model's stage boundaries out; importing the function the
measurement calls keeps the boundaries the same (docs/parallel.md, "Pipeline stages as code").
"""

from __future__ import annotations

import dataclasses
import textwrap

from memsave_nb.parallel_spec import ParallelSpec

# the schedule's class in torch.distributed.pipelining, per ParallelSpec.schedule
from memsave_nb.vocabulary import SCHEDULES

INTERLEAVED_STAGES_PER_RANK = 2  # as parallel/pipeline.py measures it

_EXAMPLES = textwrap.dedent('''\
    def stage_examples(stages, micro_batch):
        """Each stage's (inputs, outputs) for one micro-batch, run once without grad before any
        sharding: the static shapes PipelineStage is built with (no shape exchange in step 1)."""
        examples, args = [], micro_batch
        with torch.no_grad():
            for i, stage in enumerate(stages):
                out = stage(*args)
                outs = out if isinstance(out, tuple) else (out,)
                ins = args if i == 0 else tuple(torch.empty_like(a).requires_grad_(a.is_floating_point()) for a in args)
                # outputs require grad, or the stage derives no gradient shapes for its backward
                examples.append((ins, tuple(torch.empty_like(t).requires_grad_(t.is_floating_point()) for t in outs)))
                args = outs
        return examples''')

_STEP = textwrap.dedent('''\
    def pipeline_step(schedule, optimizer, inputs, target):
        """One training step: the first stage takes the inputs, the last stage the target (both split
        on dim 0 into micro-batches, loss_fn per micro-batch); then this rank's optimizer steps."""
        is_first, is_last = 0 in stage_ids, n_stages - 1 in stage_ids
        schedule.step(*(inputs if is_first else ()), target=target if is_last else None,
                      return_outputs=RETURN_OUTPUTS)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)''')


def stage_spec(spec: ParallelSpec) -> ParallelSpec:
    """Within one stage: the pipeline rank's own ranks, TP and FSDP2 (HSDP), as measured
    (``parallel.pipeline.stage_spec``: shard units are found per stage)."""
    return dataclasses.replace(
        spec,
        world_size=spec.world_size // spec.pipeline_parallel,
        pipeline_parallel=1,
        schedule="1f1b",
        microbatches=1,
        shard_modules=(),
    )


def pipeline_code(spec: ParallelSpec, model_var: str = "model", loop: str | None = None) -> tuple[list[str], list[str]]:
    """``(imports, body)``: ``model_var`` becomes this rank's stage modules (an ``nn.ModuleList``);
    ``schedule`` and ``pipeline_step`` run them. Needs ``example_inputs`` and ``loss_fn`` defined."""
    from memsave_nb.workload import DEFAULT_LOOP, output_dropped

    from .parallel import shard_code

    m, pp = model_var, spec.pipeline_parallel
    per_rank = INTERLEAVED_STAGES_PER_RANK if spec.schedule == "interleaved_1f1b" else 1
    cls = SCHEDULES[spec.schedule]
    imports = [
        "import torch",
        "from torch import nn",
        "from torch.distributed.device_mesh import init_device_mesh",
        f"from torch.distributed.pipelining import PipelineStage, {cls}",
        "from memsave_nb.parallel.stages import split_stages",
    ]
    ids = "[pp_rank]" if per_rank == 1 else f"[pp_rank + k * {pp} for k in range({per_rank})]"
    body = [
        "",
        f"# {spec.describe()}: launch with torchrun --nproc-per-node {spec.world_size} (or across nodes)",
        f"# besides {m}: example_inputs (one step's inputs to the first stage, a tuple of tensors split on",
        "# dim 0 into micro-batches) and loss_fn(output, target_chunk) (the last stage's loss per micro-batch)",
        'device_type = "cuda" if torch.cuda.is_available() else "cpu"',
        f"mesh = init_device_mesh(device_type, {spec.mesh_shape!r}, mesh_dim_names={spec.mesh_dim_names!r})",
        'device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")',
        f"n_stages, n_microbatches = {pp * per_rank}, {spec.microbatches}",
        'pp_rank = mesh.get_local_rank("pp")',
        f"stage_ids = {ids}  # this rank's stages" + ("" if per_rank == 1 else " (interleaved: every pp-th)"),
        "# the model's layers split evenly (nn.Sequential, GPT-shaped and Hugging Face decoders), as measured;",
        "# another model: any list of n_stages modules, each taking the previous one's output",
        f"all_stages = split_stages({m}, n_stages)",
        "",
        "",
        *_EXAMPLES.splitlines(),
        "",
        "",
        "examples = stage_examples(all_stages, tuple(t[: t.shape[0] // n_microbatches] for t in example_inputs))",
        "for i in stage_ids:",
        "    all_stages[i].to(device)",
    ]
    if spec.world_size > pp:  # TP, FSDP2 or HSDP within each stage, on the stage's own sub-mesh
        inner = stage_spec(spec)
        names = inner.mesh_dim_names
        more_imports, defs, calls = shard_code(inner, "stage", "stage_mesh")
        imports += more_imports
        calls = [c for c in calls if not c.startswith("# build the optimizer")]
        body += [
            f"stage_mesh = mesh[{names[0] if len(names) == 1 else names!r}]  # this stage's ranks",
            *defs,
            "",
            "",
            "def shard_stage(stage):",
            '    """TP, then FSDP2 on one stage module, as memsave_nb measured it."""',
            *(f"    {c}" for c in calls),
            "",
            "",
            "for i in stage_ids:",
            "    shard_stage(all_stages[i])",
        ]
    group = ', group=mesh.get_group("pp")' if spec.world_size > pp else ""
    first = "stages" if per_rank > 1 else "stages[0]"
    keep = not output_dropped(loop or DEFAULT_LOOP, "backward")
    body += [
        "stages = [PipelineStage(all_stages[i], i, n_stages, device, input_args=examples[i][0],",
        f"                        output_args=examples[i][1]{group}) for i in stage_ids]",
        f"schedule = {cls}({first}, n_microbatches, loss_fn=loss_fn)",
        f"{m} = nn.ModuleList(all_stages[i] for i in stage_ids)  # this rank's stages: the optimizer's parameters",
        "del all_stages, examples",
        "# build the optimizer after this line, over this rank's stages",
        "",
        "",
        *_STEP.replace("RETURN_OUTPUTS", repr(keep)).splitlines(),
        "",
        "",
        f"# optimizer = torch.optim.AdamW({m}.parameters(), lr=1e-3)  # or the workload knobs' optimizer below",
        "# pipeline_step(schedule, optimizer, inputs, target)  # every step, on every rank",
    ]
    return imports, body
