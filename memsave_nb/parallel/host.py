"""FSDP2 CPU offload: which of a rank's storages live in host memory, read from FSDP2's own records.

With ``CPUOffloadPolicy`` FSDP2 keeps each ``FSDPParam``'s sharded parameter (``_sharded_param_data``)
on the host, copies the reduced gradient shard to the host (``foreach_reduce``), and the optimizer,
whose parameters are those host shards, keeps its state and runs its step there. On a CPU mesh
host and device are one device, so FSDP2's copies between them are no-ops; the step's storages are
the same, and this module tells which of them a GPU run keeps on the host:

- the storage of every offloaded ``FSDPParam._sharded_param_data``;
- the storage of every offloaded parameter's gradient (``sharded_param.grad``);
- the optimizer state of those parameters, and whatever the optimizer step allocates.

Everything else (all-gather and reduce-scatter buffers, gathered parameters, activations,
temporaries, inputs, module buffers) is device memory.

What a CPU mesh cannot show are the device-side copies themselves: the H2D copy of each shard
before its all-gather and the device-side gradient shard before its D2H copy (``copy_bounds``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..workload import iter_tensors
from .apply import fsdp_params
from .tracker import local_shard


def offloaded_params(model: nn.Module) -> list[Any]:
    """FSDP2's records (``FSDPParam``) of the parameters it offloads to the host."""
    return [fp for fp in fsdp_params(model) if getattr(fp, "offload_to_cpu", False)]


def host_records(tracker: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    """Indices of the tracker's records that a GPU run keeps in host memory (empty: no offload).

    Call at the end of the tracked step, while gradients and optimizer state are alive.
    """
    fps = offloaded_params(model)
    if not fps:
        return set()
    tensors: list[torch.Tensor] = []
    for fp in fps:
        tensors.append(fp._sharded_param_data)
        param = fp.sharded_param
        if param.grad is not None:
            tensors.append(local_shard(param.grad))
        if optimizer is not None:
            tensors.extend(local_shard(t) for t in iter_tensors(optimizer.state.get(param, {})))
    out = {tracker.record_of(t) for t in tensors}
    # the optimizer steps on the host shards: what its step allocates is host memory too
    out |= {i for i, rec in enumerate(tracker.records) if rec.phase == "optimizer"}
    out.discard(None)
    return out


def _groups(model: nn.Module) -> list[list[Any]]:
    out = []
    for mod in model.modules():
        get = getattr(mod, "_get_fsdp_state", None)
        group = getattr(get(), "_fsdp_param_group", None) if get is not None else None
        if group is not None:
            fps = [fp for fp in group.fsdp_params if getattr(fp, "offload_to_cpu", False)]
            if fps:
                out.append(fps)
    return out


def _padded_bytes(fp: Any, dtype: torch.dtype) -> int:
    return fp.padded_sharded_param_size.numel() * dtype.itemsize


def copy_bounds(model: nn.Module) -> tuple[int, int]:
    """Upper bounds (bytes) of the device-side offload copies a CPU mesh cannot show, for one rank.

    - H2D: before each all-gather FSDP2 copies every shard of the group to the device in its
      original dtype (``all_gather_inputs``: ``.to(device)``). Without a ``param_dtype`` these
      copies are the all-gather inputs, alive together until copied into the all-gather buffer: the
      group's padded shard bytes. With a different ``param_dtype`` each copy is cast at once (the
      cast is seen, as a communication buffer), so one parameter's shard at a time.
    - D2H: the reduced gradient shards of a group sit on the device, in the parameters' dtype, until
      copied to the host (``foreach_reduce``): the group's padded shard bytes.

    Each is the largest group's figure; both are transient, so they add to the device peak only if
    they coincide with it (0 .. bound).
    """
    h2d = d2h = 0
    for fps in _groups(model):
        group = sum(_padded_bytes(fp, fp.orig_dtype) for fp in fps)
        cast = [fp for fp in fps if fp.param_dtype is not None and fp.param_dtype != fp.orig_dtype]
        if cast:
            h2d = max(h2d, max(_padded_bytes(fp, fp.orig_dtype) for fp in fps))
        else:
            h2d = max(h2d, group)
        if any(fp.sharded_param.requires_grad for fp in fps):
            d2h = max(d2h, sum(_padded_bytes(fp, fp.orig_dtype) for fp in fps if fp.sharded_param.requires_grad))
    return h2d, d2h
