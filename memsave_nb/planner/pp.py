"""Pipeline stages in the layout planner: which stage counts are searched, how a stage is measured,
and the schedule's bubble in the step time. See docs/planner.md, "Pipeline stages".

A PP candidate is ``ParallelSpec(pipeline_parallel=p, tensor_parallel=t, schedule="1f1b",
microbatches=m)``: TP ``t`` (the degrees searched) and FSDP2 over the rest of each stage's
``world / p`` ranks (the mesh ``(pp, shard, tp)``), measured with
``parallel.measure_pipeline``: torch's own ``PipelineStage`` and ``Schedule1F1B`` on the fake group.

- Stage counts: ``p`` in {2, 4, 8} dividing the GPU count and the model's blocks (each stage the
  same number of blocks), on a model ``split_stages`` can split (``nn.Sequential``, GPT-shaped,
  a Hugging Face decoder).
- Micro-batches: the most the per-rank batch allows (``max_micro_batches`` at most): 1F1B's bubble
  ``(p - 1) / m`` shrinks with ``m`` and its in-flight activations do not grow with it (stage ``i``
  holds ``min(m, p - i)`` micro-batches), so fewer micro-batches are never faster nor smaller.
- Memory: measured with its own ``m`` micro-batches (1F1B's in-flight activations stop growing at
  ``p``, but ``PipelineStage`` keeps a receive buffer per micro-batch and the last stage a loss per
  micro-batch: measuring ``min(m, p)`` read PP 2 x FSDP2 2 on a 4-block GPT 72,304 B short at
  ``m = 4``), on the first and the last stage (the first
  holds the most micro-batches and the embedding, the last the head and the loss; a middle stage
  holds fewer micro-batches of as many blocks), each stage cut to 3 and 4 blocks and extrapolated to
  its share of the depth (``depth.extrapolate(stages=p)``).
- Time: per micro-batch a stage computes ``1 / p`` of the single-device forward and backward;
  1F1B (and GPipe) take ``m + p - 1`` such slots per direction (``Schedule1F1B``: stage ``i`` runs
  ``p - 1 - i`` warm-up forwards, ``m`` steady 1F1B pairs less the warm-up, the cool-down
  backwards; the last stage waits ``p - 1`` slots for its first input): ``(m + p - 1) / p`` of one
  device's time over ``m`` micro-batches, the bubble ``(p - 1) / m`` of the useful time (Huang et
  al., GPipe, 2019; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", 2021, section 2.2.1). The sends (activations forward, gradients back) are the
  payloads the measured ranks sent (``c10d.send``), over the slowest link a stage boundary crosses,
  on the critical path (no overlap assumed).
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from memsave_nb.parallel_spec import ParallelSpec
from memsave_nb.planner.depth import Blocks

__all__ = ["PP_DEGREES", "pipeline_specs", "pipeline_seconds", "measured_stages"]

PP_DEGREES = (1, 2, 4, 8)
SCHEDULE = "1f1b"


def splittable(model: nn.Module) -> bool:
    from memsave_nb.parallel.stages import is_gpt_shaped, is_hf_decoder, unwrap_peft

    model = unwrap_peft(model)
    return isinstance(model, nn.Sequential) or is_gpt_shaped(model) or is_hf_decoder(model)


def pipeline_specs(
    gpus: int, model: nn.Module, blocks: Blocks, pps: Sequence[int], tps: Sequence[int] = (1,)
) -> tuple[list[ParallelSpec], list[str]]:
    """PP (x TP) x FSDP2 specs (one micro-batch as placeholder: the candidate sets it) and, in
    words, the stage counts left out and why. ``tps``: the TP degrees searched (within a node)."""
    specs: list[ParallelSpec] = []
    notes: list[str] = []
    wanted = [p for p in pps if p > 1]
    if not wanted:
        return specs, notes
    if not splittable(model):
        notes.append(
            f"pipeline stages not searched: {type(model).__name__} is neither an nn.Sequential, GPT-shaped "
            "nor a Hugging Face decoder (measure_pipeline takes stages=fn(model, n) for it)"
        )
        return specs, notes
    depth = len(model) if isinstance(model, nn.Sequential) else blocks.depth
    for p in wanted:
        if gpus % p or depth % p:
            notes.append(f"PP {p}: {gpus} GPUs and {depth} blocks do not both split {p} ways")
            continue
        specs += [
            ParallelSpec(world_size=gpus, pipeline_parallel=p, tensor_parallel=tp, schedule=SCHEDULE)
            for tp in tps
            if (gpus // p) % tp == 0
        ]
    return specs, notes


def measured_stages(spec: ParallelSpec) -> tuple[int, ...]:
    """The pipeline ranks measured: the first and the last."""
    return tuple(sorted({0, spec.pipeline_parallel - 1}))


def pipeline_seconds(step_seconds: float, spec: ParallelSpec) -> tuple[float, float]:
    """(compute, bubble) seconds of one pipeline rank for a step of ``spec.microbatches`` micro-batches,
    ``step_seconds`` being one device's forward and backward of one micro-batch (module doc)."""
    p, m = spec.pipeline_parallel, spec.microbatches
    slot = step_seconds / p
    return m * slot, (p - 1) * slot
