"""Activation offloading for a region: tensors its ops save for backward go to host memory in
forward and come back in backward, as ``torch.autograd.graph.save_on_cpu`` does, except that the
region's own parameters (and views of them, ``weight.t()``) stay where they are: they are on the
device anyway, so moving them frees nothing and costs a transfer.

How it is counted:

- The host copy is made with the dispatch modes disabled, so the memory tracker (which counts
  device memory) does not see it; the device storage is freed when nothing else holds it, and
  the copy back in backward is a fresh device allocation the tracker sees. On CUDA the host
  buffer is pinned and the copy is real (the allocator's peak, ``cuda_peak_bytes``, confirms it).
- On the CPU the "host" copy is a clone in the same memory: the device peak it shows is the peak a
  GPU would have, and the bytes moved are reported as host bytes (:data:`LEDGER`; ``measure()``
  puts each step's own count in ``Measurement.host``, see ``measure/host.py``).
- Under ``FakeTensorMode`` nothing is copied: the pack keeps shape, dtype and strides, the unpack
  makes an empty tensor of that shape (values do not matter there).

Transfer time is estimated from the bytes and a link bandwidth (:data:`LINKS`); the copies run on
the compute stream (as ``save_on_cpu``'s do), so they are added to the step, not overlapped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from memsave_nb.measure.host import LEDGER, OffloadLedger, active_ledgers

__all__ = [
    "LINKS",
    "Link",
    "OffloadLedger",
    "LEDGER",
    "TRL_MIN_OFFLOAD_BYTES",
    "offloading",
    "track_offload",
    "transfer_seconds",
]

# trl 1.16 OffloadActivations(min_offload_size=1024): a saved tensor of fewer bytes stays on the device
TRL_MIN_OFFLOAD_BYTES = 1024


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_second: float  # one direction
    source: str


# One direction each: offloading copies out in forward and back in backward, never both at once.
LINKS: dict[str, Link] = {
    "pcie4": Link("PCIe 4.0 x16", 32e9, "PCI-SIG: 16 GT/s x16 = ~32 GB/s per direction (64 GB/s both ways)"),
    "pcie5": Link("PCIe 5.0 x16", 64e9, "PCI-SIG: 32 GT/s x16 = ~64 GB/s per direction (~128 GB/s both ways)"),
    "nvlink-c2c": Link(
        "NVLink-C2C (Grace Hopper)",
        450e9,
        "NVIDIA GH200 / TransformerEngine docs: 900 GB/s total, 450 GB/s per direction",
    ),
}


@contextlib.contextmanager
def track_offload() -> Iterator[OffloadLedger]:
    """Reset the process-wide ledger, run the body, and yield it: ``peak_bytes`` is the host memory
    the body's offloaded regions hold at most. ``measure()`` keeps its own per-step ledger
    (``Measurement.host``); this one sees every step since the reset."""
    LEDGER.reset()
    yield LEDGER


def _nbytes(t: torch.Tensor) -> int:
    """Bytes one copy of ``t`` moves (its elements, not its whole storage: q, k, v views of one
    qkv output are copied one by one, as save_on_cpu copies them)."""
    return t.numel() * t.element_size()


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _Packed:
    """One offloaded tensor. Its bytes leave the ledger when backward reloads it, or when the
    graph that holds it dies unreloaded (a failed step): the ledger never keeps a dead step's bytes."""

    __slots__ = ("host", "device", "meta", "nbytes", "released", "ledgers")

    def __init__(self) -> None:
        self.released = True  # nothing counted yet

    def count(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.released = False
        self.ledgers = active_ledgers()  # this thread's, now: backward may release on another thread
        for ledger in self.ledgers:
            ledger.add(nbytes)

    def release(self, returned: bool = False) -> None:
        if not self.released:
            self.released = True
            for ledger in self.ledgers:
                ledger.remove(self.nbytes, returned=returned)

    def __del__(self) -> None:
        self.release()


@contextlib.contextmanager
def offloading(module: nn.Module, min_bytes: int = 0) -> Iterator[None]:
    """Offload what ``module``'s forward saves for backward (its parameters stay, and so does a
    tensor of fewer than ``min_bytes`` bytes, as TRL keeps those under its ``min_offload_size``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    params = {id(p) for p in module.parameters()}
    on_cuda = torch.cuda.is_available()

    def pack(t: torch.Tensor) -> Any:
        if id(t) in params or (t._base is not None and id(t._base) in params) or t.device.type == "meta":
            return t
        nbytes = _nbytes(t)
        if nbytes < min_bytes:
            return t
        packed = _Packed()
        packed.device = t.device
        if _is_fake(t):
            packed.host = None
            packed.meta = (t.shape, t.stride(), t.dtype, t.requires_grad)
        else:
            with _disable_current_modes():  # the host copy is not device memory: hide it from trackers
                if t.device.type == "cuda":
                    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=on_cuda)
                    host.copy_(t, non_blocking=True)
                else:
                    host = t.detach().clone()
            packed.host = host
            packed.meta = None
        packed.count(nbytes)
        return packed

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        packed.release(returned=True)
        if packed.meta is not None:
            shape, stride, dtype, _ = packed.meta
            return torch.empty_strided(shape, stride, dtype=dtype, device=packed.device)
        return packed.host.to(packed.device, non_blocking=True) if packed.device.type != "cpu" else packed.host.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def transfer_seconds(host_bytes: int, link: str = "pcie5") -> float:
    """Seconds to move ``host_bytes`` out in forward and back in backward over ``link``."""
    if link not in LINKS:
        from memsave_nb.errors import PlanError

        raise PlanError(f"link {link!r}: choose one of {sorted(LINKS)}")
    return 2 * host_bytes / LINKS[link].bytes_per_second
