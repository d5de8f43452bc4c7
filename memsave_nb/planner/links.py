"""Links between GPUs and the bytes each collective moves per step: what the layout planner adds to
the roofline's compute time.

Bandwidths are per GPU and one direction, from the vendors' datasheets (peak; NCCL's measured bus
bandwidth is lower, e.g. about 360-370 GB/s for an all-reduce over H100 NVLink): like the roofline,
they rank layouts, they do not predict seconds. A node holds ``gpus_per_node`` GPUs joined by the
intra-node link; nodes are joined by one network port per GPU (the DGX/HGX reference design).

Bytes per rank are the ring algorithm's standard factors (NCCL's docs, "Performance"; Thakur et al.,
"Optimization of Collective Communication Operations in MPICH", 2005): an all-gather or a
reduce-scatter of ``S`` bytes over ``n`` ranks sends ``(n - 1) / n * S`` per rank, an all-reduce
twice that. The payloads come from the per-rank fake run (``RankMeasurement.collectives``); before a
layout is measured, from the model's parameter bytes and a block's activation shape.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fabric", "FABRICS", "ring_all_gather", "ring_all_reduce", "fabric_for"]


@dataclass(frozen=True)
class Fabric:
    name: str
    gpus_per_node: int
    intra_bytes_per_second: float  # within a node, per GPU, one direction
    inter_bytes_per_second: float  # across nodes, per GPU, one direction
    host_bytes_per_second: float  # GPU <-> host memory (CPU offload), one direction
    source: str
    # host memory bandwidth per GPU (the node's DRAM bandwidth over its GPUs): the CPU optimizer
    # step of FSDP2's CPU offload is memory-bound, so it takes the roofline's time scaled by this
    host_memory_bytes_per_second: float = 38.4e9
    host_memory_source: str = "one socket, 8 channels DDR5-4800 (307 GB/s) over 8 GPUs (assumed)"

    def bandwidth(self, crosses_nodes: bool) -> float:
        return self.inter_bytes_per_second if crosses_nodes else self.intra_bytes_per_second


_PCIE4, _PCIE5 = 32e9, 64e9  # PCI-SIG: 16 / 32 GT/s x16, per direction (memsave_nb.offload.LINKS)

FABRICS: dict[str, Fabric] = {
    "H100": Fabric(
        "8x H100 SXM per node, NVLink 4 + 400 Gb/s InfiniBand NDR per GPU",
        8,
        450e9,
        50e9,
        _PCIE5,
        "NVIDIA H100 datasheet: NVLink 900 GB/s (both directions); DGX H100: 8x ConnectX-7 400 Gb/s",
        76.8e9,
        "DGX H100: 2x Xeon 8480C, 8 channels DDR5-4800 each (2 x 307 GB/s) over 8 GPUs",
    ),
    "H200": Fabric(
        "8x H200 SXM per node, NVLink 4 + 400 Gb/s InfiniBand NDR per GPU",
        8,
        450e9,
        50e9,
        _PCIE5,
        "NVIDIA H200 datasheet: NVLink 900 GB/s (both directions); DGX H200: 8x ConnectX-7 400 Gb/s",
        76.8e9,
        "DGX H200: 2x Xeon 8480C, 8 channels DDR5-4800 each (2 x 307 GB/s) over 8 GPUs",
    ),
    "A100": Fabric(
        "8x A100 SXM per node, NVLink 3 + 200 Gb/s InfiniBand HDR per GPU",
        8,
        300e9,
        25e9,
        _PCIE4,
        "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions); DGX A100: 8x ConnectX-6 200 Gb/s",
        51.2e9,
        "DGX A100: 2x EPYC 7742, 8 channels DDR4-3200 each (2 x 205 GB/s) over 8 GPUs",
    ),
    "L4": Fabric(
        "8x L4 per node over PCIe 4.0 (no NVLink) + 100 Gb/s Ethernet",
        8,
        _PCIE4,
        12.5e9,
        _PCIE4,
        "NVIDIA L4 datasheet: PCIe Gen4 x16 64 GB/s (both directions), no NVLink; 100 GbE assumed across nodes",
    ),
    "RTX 4090": Fabric(
        "8x RTX 4090 per node over PCIe 4.0 (no NVLink) + 100 Gb/s Ethernet",
        8,
        _PCIE4,
        12.5e9,
        _PCIE4,
        "NVIDIA Ada whitepaper: PCIe Gen4 x16, no NVLink; 100 GbE assumed across nodes",
    ),
}
FABRICS["A100-40"] = FABRICS["A100"]


def fabric_for(gpu: str) -> Fabric:
    """The fabric of a GPU kind named in ``roofline.GPUS`` (the kinds share their names)."""
    from memsave_nb.errors import PlanError, quoted

    if gpu not in FABRICS:
        raise PlanError(f"gpu {quoted(gpu)}: choose one of {sorted(FABRICS)}")
    return FABRICS[gpu]


def ring_all_gather(nbytes: float, n: int) -> float:
    """Bytes each rank sends to all-gather (or reduce-scatter) ``nbytes`` over ``n`` ranks."""
    return (n - 1) / n * nbytes if n > 1 else 0.0


def ring_all_reduce(nbytes: float, n: int) -> float:
    """Bytes each rank sends to all-reduce ``nbytes`` over ``n`` ranks (reduce-scatter + all-gather)."""
    return 2 * ring_all_gather(nbytes, n)
