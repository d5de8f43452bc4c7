"""The cuBLAS workspace a GPU step reserves: one allocation per (handle, stream), from the caching
allocator, at the step's first matmul, kept for the life of the process.

Why: no dispatch-level tracker sees it (cuBLAS asks the allocator below the op), yet it sits in
``max_memory_reserved``. Read from PyTorch's ``aten/src/ATen/cuda/CublasHandlePool.cpp``
(torch 2.13-era, read through the search tools):

- ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE:COUNT" pairs, SIZE in KiB) sums
  ``SIZE * 1024 * COUNT``; unset (or unparsable), the default is ``4096 * 8 * 1024`` (32 MiB) on
  compute capability 9.x-12.x (Hopper, Blackwell) and ``4096 * 1024 * 2 + 16 * 1024 * 8`` (":4096:2:16:8",
  8,519,680 B) below;
- ``setWorkspaceForHandle`` / ``getNewWorkspace``: ``CUDACachingAllocator::get()->allocate(size)``,
  cached in ``cublas_handle_stream_to_workspace`` under (handle, stream);
- ``getCUDABlasLtWorkspace``: with the unified workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``,
  default on) cuBLASLt uses the same block (its own default, 1 MiB, is smaller).

One stream and one thread run the step, so one workspace. Newer torch builds may leave it to
cuBLAS's own default (``TORCH_CUBLAS_WORKSPACE_CACHE`` unset): the same order of bytes on the GPU,
outside the allocator; docs/allocator.md says so.
"""

from __future__ import annotations

import os
import re

from ..workload import SIZED_GPUS, check_gpu

HOPPER_AND_UP = 4096 * 8 * 1024
BELOW_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8
SOURCE = "CublasHandlePool.cpp: one per stream; 32 MiB on sm90+, :4096:2:16:8 below, or CUBLAS_WORKSPACE_CONFIG"


def workspace_bytes(gpu: str | None = None, config: str | None = None) -> int:
    """The bytes of one cuBLAS workspace on ``gpu`` (None: the default, an H100) under ``config``
    (default: the environment's ``CUBLAS_WORKSPACE_CONFIG``)."""
    major = SIZED_GPUS[check_gpu(gpu)][0]
    default = HOPPER_AND_UP if 9 <= major <= 12 else BELOW_HOPPER
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if not config:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)
