"""A roofline per named device: an op takes ``max(flops / peak FLOP/s, bytes / bandwidth)`` plus a
fixed launch overhead. Figures are the vendors' datasheet peaks (dense, no sparsity); a real step
reaches a fraction of them, so estimated times rank plans, they do not predict seconds.

``calibrate_host()`` measures this machine's CPU the same way (a matmul's FLOP/s, a large copy's
bandwidth, a tiny op's overhead) so that real-mode estimates on the CPU can be compared with
measured step times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["Device", "GPUS", "calibrate_host", "device_named"]


@dataclass(frozen=True)
class Device:
    name: str
    low_precision_flops: float  # bf16/fp16 dense tensor-core FLOP/s
    fp32_flops: float  # fp32 FLOP/s (no TF32: PyTorch's default for matmuls)
    bytes_per_second: float  # memory bandwidth
    memory_gb: float
    launch_seconds: float = 4e-6  # per op: kernel launch / dispatch overhead
    source: str = ""

    def op_seconds(self, flops: float, nbytes: float, low_precision: bool) -> float:
        peak = self.low_precision_flops if low_precision else self.fp32_flops
        return max(flops / peak, nbytes / self.bytes_per_second) + self.launch_seconds


GPUS: dict[str, Device] = {
    "H100": Device(
        "H100 SXM",
        989e12,
        67e12,
        3.35e12,
        80,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 989 TFLOPS dense, FP32 67 TFLOPS, HBM3 3.35 TB/s)",
    ),
    "H200": Device(
        "H200 SXM",
        989e12,
        67e12,
        4.8e12,
        141,
        source="NVIDIA H200 Tensor Core GPU datasheet (BF16 989 TFLOPS dense, FP32 67 TFLOPS, HBM3e 4.8 TB/s, 141 GB)",
    ),
    "A100": Device(
        "A100 SXM 80GB",
        312e12,
        19.5e12,
        2.039e12,
        80,
        source="NVIDIA A100 datasheet (BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, HBM2e 2,039 GB/s)",
    ),
    "A100-40": Device(
        "A100 SXM 40GB",
        312e12,
        19.5e12,
        1.555e12,
        40,
        source="NVIDIA A100 datasheet (40GB SXM: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, HBM2 1,555 GB/s)",
    ),
    "L4": Device(
        "L4",
        121e12,
        30.3e12,
        300e9,
        24,
        source="NVIDIA L4 datasheet (BF16 242 TFLOPS with sparsity = 121 dense, FP32 30.3 TFLOPS, 300 GB/s)",
    ),
    "RTX 4090": Device(
        "GeForce RTX 4090",
        165.2e12,
        82.6e12,
        1008e9,
        24,
        source="NVIDIA Ada Lovelace architecture whitepaper (BF16 tensor 165.2 TFLOPS dense with FP32 accumulate, FP32 82.6 TFLOPS, 1,008 GB/s)",
    ),
}


def device_named(name: str | Device) -> Device:
    if isinstance(name, Device):
        return name
    if name in GPUS:
        return GPUS[name]
    if name in ("host", "cpu"):
        return calibrate_host()
    from memsave_nb.checkpointing import PlanError
    from memsave_nb.errors import quoted

    raise PlanError(f"device {quoted(name)}: choose one of {sorted(GPUS)} or 'host'")


_HOST: Device | None = None


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrate_host() -> Device:
    """This machine's CPU as a roofline device (measured once per process)."""
    global _HOST
    if _HOST is None:
        n = 384
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3 / _median_seconds(lambda: a @ b)
        big = torch.empty(8 * 2**20 // 4)
        out = torch.empty_like(big)
        bandwidth = 2 * big.numel() * 4 / _median_seconds(lambda: out.copy_(big))
        tiny = torch.ones(4)
        overhead = _median_seconds(lambda: [tiny.add(1) for _ in range(100)]) / 100
        _HOST = Device(
            "this CPU (calibrated)",
            flops,
            flops,
            bandwidth,
            0,
            overhead,
            source="measured: 384x384 matmul, 8 MiB copy, 100 tiny adds",
        )
    return _HOST
