"""A fake process group and device mesh for one rank, torn down afterwards.

``init_process_group("fake", store=FakeStore(), rank=r, world_size=N)`` (torch's testing fake
backend) runs FSDP2/DDP in one process: collectives return at once, nothing is communicated. The
mesh is built outside ``FakeTensorMode``. On exit the default group is destroyed, so
``torch.distributed.is_initialized()`` is what it was before (False: an existing default group is
refused, since a process holds only one).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch.distributed as dist

from ..parallel_spec import ParallelError, ParallelSpec


@contextlib.contextmanager
def fake_process_group(spec: ParallelSpec, rank: int) -> Iterator[object]:
    """Yield the device mesh of ``rank`` on a fake group of ``spec.world_size`` ranks."""
    if not dist.is_available():
        raise ParallelError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        raise ParallelError(
            "a default process group is already initialized in this process; size parallel plans in a process without one"
        )
    if not 0 <= rank < spec.world_size:
        raise ParallelError(f"rank {rank} is outside world size {spec.world_size}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.world_size)
    try:
        mesh = init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=spec.mesh_dim_names)
        yield mesh
    finally:
        dist.destroy_process_group()


def settle_forked_rank() -> None:
    """Call first in a rank process forked from a process that ran earlier steps (tests, notebooks).

    The fork copies the parent's uncollected garbage, which can hold a ``ProcessGroupGloo`` of an
    earlier run: collecting it in the child joins its worker threads, which a fork does not copy,
    and the rank hangs forever (seen in the full test suite: a ``gc.collect()`` before a step hung).
    ``gc.freeze()`` moves everything inherited out of the collector's reach: it stays as it was in
    the parent (no memory is added; the rank measures its own step's storages only)."""
    gc.freeze()
