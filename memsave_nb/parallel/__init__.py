"""Per-rank memory under FSDP2 and DDP, sized with PyTorch's own distributed code on a fake process group.

``measure_parallel(workload, ParallelSpec(world_size=8))`` returns a ``ParallelMeasurement``: each
measured rank's peak split into sharded parameters, gathered parameters, buffers, communication
buffers, gradients, optimizer state, activations, inputs and temporaries, the worst rank, and the
lines no dispatch-level counter sees (communication library buffers, CUDA context, fragmentation).
"""

from .cross_check import CrossCheckRow, cross_check
from .measure import measure_parallel, measure_rank
from .pipeline import measure_pipeline
from .stages import split_stages
from .result import CATEGORIES, ParallelMeasurement, RankMeasurement, Unseen, unseen_lines
from ..parallel_spec import ParallelError, ParallelSpec

__all__ = [
    "cross_check",
    "CATEGORIES",
    "CrossCheckRow",
    "ParallelError",
    "ParallelMeasurement",
    "ParallelSpec",
    "RankMeasurement",
    "Unseen",
    "measure_parallel",
    "measure_pipeline",
    "measure_rank",
    "split_stages",
    "unseen_lines",
]
