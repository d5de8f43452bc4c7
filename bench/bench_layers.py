"""Stock layers vs memsave_nb.layers on the paper's fine-tuning cases, side by side.

For each model and case it measures, in one run and on the same parameters (the model is
converted in place and reverted between runs), the saved activations and the peak of one
training step with the project's engine, and the step time (median of interleaved runs),
then prints ratios to stock and writes JSON to ``bench/results/``.

    python bench/bench_layers.py                 # ResNet-18/101-shaped + demo CNN, quick
    python bench/bench_layers.py --size 224 --batch 8 --bytes-mode fake   # the paper's shape

Reference ratios (the paper's code on this CPU, batch 8, 224x224) are printed beside ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memsave_nb.layers import convert, revert  # noqa: E402
from memsave_nb.measure import measure  # noqa: E402
from memsave_nb.workload import Workload  # noqa: E402

CASES = ("all", "input", "input_bn_eval", "norm", "conv", "first_quarter", "last_quarter_input")
REFERENCE = {  # ../shared/CONTEXT.md: the paper's layers / stock, saved activations
    "resnet18": dict(all=0.954, input=0.642, input_bn_eval=0.182, norm=0.642, conv=0.954,
                     first_quarter=0.828, last_quarter_input=0.665),
    "resnet101": dict(all=1.088, input=0.644, input_bn_eval=0.129, norm=0.644, conv=1.088,
                      first_quarter=0.858, last_quarter_input=0.713),
}


# -- torchvision-free ResNets (same layout as torchvision's resnet18 / resnet101) -------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _downsample(cin, width, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, width * 4, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def resnet(depth: int, num_classes: int = 1000) -> nn.Module:
    block, counts = {18: (BasicBlock, (2, 2, 2, 2)), 101: (Bottleneck, (3, 4, 23, 3))}[depth]
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, (width, count) in enumerate(zip((64, 128, 256, 512), counts)):
        stage = []
        for j in range(count):
            stage.append(block(cin, width, 2 if (i > 0 and j == 0) else 1))
            cin = width * block.expansion
        layers.append(nn.Sequential(*stage))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def demo_cnn() -> nn.Module:
    from memsave_nb.zoo import make

    return make("cnn").model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: resnet(18),
    "resnet101": lambda: resnet(101),
    "demo_cnn": demo_cnn,
}


# -- the cases ---------------------------------------------------------------------------------
def apply_case(model: nn.Module, case: str) -> bool:
    """Set requires_grad and train/eval for ``case``; returns whether the input needs grad."""
    model.train()
    model.requires_grad_(False)
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    quarter = max(1, len(owners) // 4)
    if case == "all":
        model.requires_grad_(True)
    elif case == "input_bn_eval":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    elif case == "norm":
        for m in owners:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.requires_grad_(True)
    elif case == "conv":
        for m in owners:
            if isinstance(m, nn.modules.conv._ConvNd):
                m.requires_grad_(True)
    elif case == "first_quarter":
        for m in owners[:quarter]:
            m.requires_grad_(True)
    elif case == "last_quarter_input":
        for m in owners[-quarter:]:
            m.requires_grad_(True)
    return case in ("input", "input_bn_eval", "last_quarter_input")


def _workload(model: nn.Module, batch: Tensor, input_grad: bool) -> Workload:
    return Workload(model, batch, loss=lambda out: out.sum(), optimizer=None,
                    input_requires_grad=input_grad, name="bench")


def _step_seconds(model: nn.Module, batch: Tensor, input_grad: bool) -> float:
    """CPU seconds this process spent on forward+backward: with one torch thread this is
    the step's cost even while other jobs share the cores (wall time is not, here)."""
    x = batch.clone().requires_grad_(input_grad)
    start = time.process_time()
    model(x).sum().backward()
    seconds = time.process_time() - start
    model.zero_grad(set_to_none=True)
    return seconds


def bench_case(model: nn.Module, batch: Tensor, case: str, repeats: int, bytes_mode: str,
               bytes_batch: Tensor) -> dict:
    input_grad = apply_case(model, case)
    row: dict = {"case": case}
    for label in ("stock", "ours"):
        conversion = convert(model) if label == "ours" else None
        try:
            m = measure(_workload(model, bytes_batch, input_grad), mode=bytes_mode, repeats=0,
                        flops=False)
            row[f"{label}_saved_bytes"] = m.saved_bytes
            row[f"{label}_peak_bytes"] = m.peak_bytes
        finally:
            if conversion is not None:
                revert(conversion)
    times: dict[str, list[float]] = {"stock": [], "ours": []}
    _step_seconds(model, batch, input_grad)  # warm-up
    for _ in range(repeats):  # interleaved, so drifting machine load hits both alike
        times["stock"].append(_step_seconds(model, batch, input_grad))
        conversion = convert(model)
        try:
            if not times["ours"]:
                _step_seconds(model, batch, input_grad)  # warm-up
            times["ours"].append(_step_seconds(model, batch, input_grad))
        finally:
            revert(conversion)
    for label in ("stock", "ours"):
        row[f"{label}_step_seconds"] = statistics.median(times[label])
    row["saved_ratio"] = row["ours_saved_bytes"] / row["stock_saved_bytes"]
    row["peak_ratio"] = row["ours_peak_bytes"] / row["stock_peak_bytes"]
    row["time_ratio"] = row["ours_step_seconds"] / row["stock_step_seconds"]
    return row


# -- transformers (the demo decoders): token input, so no input-gradient cases -------------
GPT_CASES = ("all", "norm", "first_quarter", "last_quarter")


def gpt_model(variant: str) -> tuple[nn.Module, dict]:
    from memsave_nb.zoo import GPTConfig, gpt

    cfg = GPTConfig() if variant == "gpt" else GPTConfig(mlp="swiglu", norm="rmsnorm")
    workload = gpt(cfg, batch_size=8)
    return workload.model, workload.batch


def apply_gpt_case(model: nn.Module, case: str) -> None:
    model.train()
    model.requires_grad_(case == "all")
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    quarter = max(1, len(owners) // 4)
    if case == "norm":
        for m in owners:
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.requires_grad_(True)
    elif case == "first_quarter":
        for m in owners[:quarter]:
            m.requires_grad_(True)
    elif case == "last_quarter":
        for m in owners[-quarter:]:
            m.requires_grad_(True)


def bench_gpt_case(model: nn.Module, batch: dict, case: str, repeats: int) -> dict:
    apply_gpt_case(model, case)
    row: dict = {"case": case}
    workload = Workload(model, batch, optimizer=None, name="bench")
    for label in ("stock", "ours"):
        conversion = convert(model) if label == "ours" else None
        try:
            torch.manual_seed(0)
            m = measure(workload, mode="real", repeats=0, flops=False)
            row[f"{label}_saved_bytes"] = m.saved_bytes
            row[f"{label}_peak_bytes"] = m.peak_bytes
        finally:
            if conversion is not None:
                revert(conversion)

    def step() -> float:
        start = time.process_time()
        model(**batch).loss.backward()
        seconds = time.process_time() - start
        model.zero_grad(set_to_none=True)
        return seconds

    times: dict[str, list[float]] = {"stock": [], "ours": []}
    step()
    for _ in range(repeats):
        times["stock"].append(step())
        conversion = convert(model)
        try:
            if not times["ours"]:
                step()
            times["ours"].append(step())
        finally:
            revert(conversion)
    for label in ("stock", "ours"):
        row[f"{label}_step_seconds"] = statistics.median(times[label])
    row["saved_ratio"] = row["ours_saved_bytes"] / row["stock_saved_bytes"]
    row["peak_ratio"] = row["ours_peak_bytes"] / row["stock_peak_bytes"]
    row["time_ratio"] = row["ours_step_seconds"] / row["stock_step_seconds"]
    row["reference_saved_ratio"] = None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet18,resnet101,demo_cnn")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--gpts", default="gpt,gpt_rmsnorm_swiglu",
                        help="demo decoders to run ('' for none)")
    parser.add_argument("--size", type=int, default=112, help="image side for timing")
    parser.add_argument("--batch", type=int, default=4, help="batch for timing")
    parser.add_argument("--bytes-size", type=int, default=224, help="image side for bytes")
    parser.add_argument("--bytes-batch", type=int, default=8, help="batch for bytes")
    parser.add_argument("--bytes-mode", default="fake", choices=("fake", "real"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for timing (1: steadier on a shared machine)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "layers.json"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    results: dict = {"settings": vars(args), "torch": torch.__version__, "models": {}}
    for name in args.models.split(","):
        model = MODELS[name]()
        batch = torch.randn(args.batch, 3, args.size, args.size)
        bytes_batch = torch.randn(args.bytes_batch, 3, args.bytes_size, args.bytes_size)
        if args.bytes_mode == "real" and (args.bytes_batch, args.bytes_size) == (args.batch, args.size):
            bytes_batch = batch
        rows = []
        for case in args.cases.split(","):
            row = bench_case(model, batch, case, args.repeats, args.bytes_mode, bytes_batch)
            row["reference_saved_ratio"] = REFERENCE.get(name, {}).get(case)
            rows.append(row)
            print(_format_row(name, row), flush=True)
        results["models"][name] = rows
    for name in filter(None, args.gpts.split(",")):
        model, batch = gpt_model(name)
        rows = []
        for case in GPT_CASES:
            row = bench_gpt_case(model, batch, case, args.repeats)
            rows.append(row)
            print(_format_row(name, row), flush=True)
        results["models"][name] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0


HEADER = (f"{'model':18s} {'case':19s} {'stock saved MB':>14s} {'saved ours/stock':>16s} "
          f"{'reference':>9s} {'peak ours/stock':>15s} {'time ours/stock':>15s}")


def _format_row(model: str, row: dict) -> str:
    if not getattr(_format_row, "printed", False):
        print(HEADER)
        _format_row.printed = True  # type: ignore[attr-defined]
    ref = row["reference_saved_ratio"]
    return (f"{model:18s} {row['case']:19s} {row['stock_saved_bytes'] / 2**20:14.1f} "
            f"{row['saved_ratio']:16.3f} {('' if ref is None else f'{ref:.3f}'):>9s} "
            f"{row['peak_ratio']:15.3f} {row['time_ratio']:15.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
