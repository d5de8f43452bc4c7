"""Stock layers vs memsave_nb.layers on the paper's fine-tuning cases, side by side.

For each model and case it measures, in one run and on the same parameters (the model is
converted in place and reverted between runs), the saved activations and the peak of one
training step with the project's engine, and the step time (median of interleaved runs),
then prints ratios to stock and writes JSON to ``bench/results/``.

    python bench/bench_layers.py                 # every model and case (long on 2 cores)
    python bench/bench_layers.py --quick --out /tmp/layers.json   # smoke test: demo CNN and GPT, tiny shapes
    python bench/bench_layers.py --repeats 3 --batch 4 --size 112 --peak-batches 2   # a fast look
    python bench/bench_layers.py --models mobilenet_v2 --cases all,input_bn_eval --gpts ""
    python bench/bench_layers.py --kernels --out bench/results/kernels.json   # C kernels alone

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
    "resnet18": dict(
        all=0.954,
        input=0.642,
        input_bn_eval=0.182,
        norm=0.642,
        conv=0.954,
        first_quarter=0.828,
        last_quarter_input=0.665,
    ),
    "resnet101": dict(
        all=1.088,
        input=0.644,
        input_bn_eval=0.129,
        norm=0.644,
        conv=1.088,
        first_quarter=0.858,
        last_quarter_input=0.713,
    ),
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
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
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


# -- today's CNN shapes (torchvision's layouts, built here: torchvision does not import) -------
def _conv_bn_act(cin: int, cout: int, k: int, stride: int, groups: int, act: type[nn.Module] | None) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act(inplace=True))
    return layers


class InvertedResidual(nn.Module):
    """MobileNetV2's block (ReLU6) or, with ``se`` and SiLU, EfficientNet's MBConv."""

    def __init__(
        self,
        cin: int,
        cout: int,
        stride: int,
        expand: int,
        k: int = 3,
        act: type[nn.Module] = nn.ReLU6,
        se: bool = False,
    ) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += _conv_bn_act(cin, hidden, 1, 1, 1, act)
        layers += _conv_bn_act(hidden, hidden, k, stride, hidden, act)  # depthwise
        if se:
            layers.append(SqueezeExcite(hidden, max(1, cin // 4)))
        layers += _conv_bn_act(hidden, cout, 1, 1, 1, None)
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return x + out if self.residual else out


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


def mobilenet_v2(num_classes: int = 1000) -> nn.Module:
    """torchvision's mobilenet_v2 layout: inverted residuals, ReLU6(inplace), depthwise 3x3."""
    settings = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ]
    layers = _conv_bn_act(3, 32, 3, 2, 1, nn.ReLU6)
    cin = 32
    for t, c, n, s in settings:
        for i in range(n):
            layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
            cin = c
    layers += _conv_bn_act(cin, 1280, 1, 1, 1, nn.ReLU6)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, num_classes)]
    return nn.Sequential(*layers)


def efficientnet_b0(num_classes: int = 1000) -> nn.Module:
    """torchvision's efficientnet_b0 layout: MBConv with SiLU, depthwise 3x3/5x5,
    squeeze-excite (no stochastic depth)."""
    settings = [
        (1, 3, 1, 16, 1),
        (6, 3, 2, 24, 2),
        (6, 5, 2, 40, 2),
        (6, 3, 2, 80, 3),
        (6, 5, 1, 112, 3),
        (6, 5, 2, 192, 4),
        (6, 3, 1, 320, 1),
    ]
    layers = _conv_bn_act(3, 32, 3, 2, 1, nn.SiLU)
    cin = 32
    for t, k, s, c, n in settings:
        for i in range(n):
            layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t, k, nn.SiLU, se=True))
            cin = c
    layers += _conv_bn_act(cin, 1280, 1, 1, 1, nn.SiLU)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, num_classes)]
    return nn.Sequential(*layers)


class ChannelsLastLayerNorm(nn.Module):
    """LayerNorm over channels of an (N, C, H, W) tensor, as ConvNeXt's downsampling does."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm, Linear 4x, GELU, Linear, layer scale, residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor) -> Tensor:
        out = self.dwconv(x).permute(0, 2, 3, 1)  # (N, H, W, C)
        out = self.pwconv2(self.act(self.pwconv1(self.norm(out))))
        return x + (self.gamma * out).permute(0, 3, 1, 2)


def convnext_tiny(num_classes: int = 1000) -> nn.Module:
    """ConvNeXt-T's layout (depths 3, 3, 9, 3; widths 96..768; no stochastic depth)."""
    dims, depths = (96, 192, 384, 768), (3, 3, 9, 3)
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), ChannelsLastLayerNorm(dims[0])]
    for i, (dim, depth) in enumerate(zip(dims, depths)):
        if i > 0:
            layers += [ChannelsLastLayerNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, 2)]
        layers += [ConvNeXtBlock(dim) for _ in range(depth)]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LayerNorm(dims[-1], eps=1e-6),
        nn.Linear(dims[-1], num_classes),
    ]
    return nn.Sequential(*layers)


def demo_cnn() -> nn.Module:
    from memsave_nb.zoo import make

    return make("cnn").model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: resnet(18),
    "resnet101": lambda: resnet(101),
    "demo_cnn": demo_cnn,
    "mobilenet_v2": mobilenet_v2,
    "efficientnet_b0": efficientnet_b0,
    "convnext_tiny": convnext_tiny,
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
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)):
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
    return Workload(
        model, batch, loss=lambda out: out.sum(), optimizer=None, input_requires_grad=input_grad, name="bench"
    )


def _step_seconds(model: nn.Module, batch: Tensor, input_grad: bool) -> float:
    """CPU seconds this process spent on forward+backward: with one torch thread this is
    the step's cost even while other jobs share the cores (wall time is not, here)."""
    x = batch.clone().requires_grad_(input_grad)
    start = time.process_time()
    model(x).sum().backward()
    seconds = time.process_time() - start
    model.zero_grad(set_to_none=True)
    return seconds


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def peak_ratios(model: nn.Module, input_grad: bool, batches: list[int], size: int) -> dict:
    """Converted / stock peak of a training step with AdamW (fake mode) at each batch size:
    the steady-state step's (training's step 2 on, AdamW's state alive; ``measure()``'s
    default) and, beside it, the first step's."""
    ratios: dict = {"steady": {}, "first": {}}
    for b in batches:
        x = torch.randn(b, 3, size, size)
        workload = Workload(
            model, x, loss=lambda out: out.sum(), optimizer=_adamw, input_requires_grad=input_grad, name="bench"
        )
        steady, first = [], []
        for label in ("stock", "ours"):
            conversion = convert(model) if label == "ours" else None
            try:
                m = measure(workload, mode="fake", repeats=0, flops=False, steady_state=True, first_step_peak=True)
                steady.append(m.peak_bytes)
                first.append(m.first_step_peak_bytes or m.peak_bytes)
            finally:
                if conversion is not None:
                    revert(conversion)
        ratios["steady"][str(b)] = steady[1] / steady[0]
        ratios["first"][str(b)] = first[1] / first[0]
    return ratios


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), interpolated as statistics' 'inclusive'."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def time_pairs(step: Callable[[], float], model: nn.Module, repeats: int) -> dict:
    """Step time, stock vs converted, in ``repeats`` interleaved pairs whose order alternates
    (stock first, then converted first), so that drifting load hits both sides alike.

    Returns both medians, the median of the per-pair ratios with its quartiles (the spread),
    and the ratio of the two minima (the least disturbed run of each)."""
    times: dict[str, list[float]] = {"stock": [], "ours": []}

    def run(label: str) -> float:
        conversion = convert(model) if label == "ours" else None
        try:
            return step()
        finally:
            if conversion is not None:
                revert(conversion)

    run("stock")  # warm-up, both sides
    run("ours")
    for i in range(repeats):
        order = ("stock", "ours") if i % 2 == 0 else ("ours", "stock")
        for label in order:
            times[label].append(run(label))
    ratios = [o / s for o, s in zip(times["ours"], times["stock"])]
    q1, med, q3 = quartiles(ratios)
    return {
        "stock_step_seconds": statistics.median(times["stock"]),
        "ours_step_seconds": statistics.median(times["ours"]),
        "time_ratio": med,
        "time_ratio_q1": q1,
        "time_ratio_q3": q3,
        "time_ratio_min": min(times["ours"]) / min(times["stock"]),
        "step_seconds": times,
    }


def bench_case(
    model: nn.Module,
    batch: Tensor,
    case: str,
    repeats: int,
    bytes_mode: str,
    bytes_batch: Tensor,
    peak_batches: list[int] | None = None,
) -> dict:
    input_grad = apply_case(model, case)
    row: dict = {"case": case}
    if peak_batches:
        peaks = peak_ratios(model, input_grad, peak_batches, bytes_batch.shape[-1])
        row["peak_ratio_adamw"] = peaks["steady"]
        row["first_step_peak_ratio_adamw"] = peaks["first"]
    for label in ("stock", "ours"):
        conversion = convert(model) if label == "ours" else None
        try:
            m = measure(_workload(model, bytes_batch, input_grad), mode=bytes_mode, repeats=0, flops=False)
            row[f"{label}_saved_bytes"] = m.saved_bytes
            row[f"{label}_peak_bytes"] = m.peak_bytes
        finally:
            if conversion is not None:
                revert(conversion)
    if repeats:
        row.update(time_pairs(lambda: _step_seconds(model, batch, input_grad), model, repeats))
    row["saved_ratio"] = row["ours_saved_bytes"] / row["stock_saved_bytes"]
    row["peak_ratio"] = row["ours_peak_bytes"] / row["stock_peak_bytes"]
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

    if repeats:
        row.update(time_pairs(step, model, repeats))
    row["saved_ratio"] = row["ours_saved_bytes"] / row["stock_saved_bytes"]
    row["peak_ratio"] = row["ours_peak_bytes"] / row["stock_peak_bytes"]
    row["reference_saved_ratio"] = None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--gpts", default="gpt,gpt_rmsnorm_swiglu", help="demo decoders to run ('' for none)")
    parser.add_argument("--size", type=int, default=224, help="image side for timing (default: the paper's cases, 224)")
    parser.add_argument("--batch", type=int, default=8, help="batch for timing (default: the paper's cases, 8)")
    parser.add_argument("--bytes-size", type=int, default=224, help="image side for bytes")
    parser.add_argument("--bytes-batch", type=int, default=8, help="batch for bytes")
    parser.add_argument("--bytes-mode", default="fake", choices=("fake", "real"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for timing (1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--peak-batches",
        default="1,2,8,32",
        help="batch sizes of the AdamW peak-ratio columns (fake mode; '' for none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: demo CNN (cases all, input) at 2 x 32^2 and the GPT demo, 2 timing "
        "repeats, AdamW peaks at batch 2 only (the old fast look: --repeats 3 --batch 4 "
        "--size 112 --peak-batches 2)",
    )
    parser.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    parser.add_argument("--bits", action="store_true", help="only the mask-packing microbench (numpy vs torch ops)")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="only the fused C kernels at each SIMD level the CPU has, against stock's ops",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "layers.json"))
    args = parser.parse_args(argv)
    if args.quick:  # two repeats: the timing quartiles need two
        args.models, args.cases, args.gpts, args.repeats = "demo_cnn", "all,input", "gpt", 2
        args.peak_batches = "2" if args.peak_batches else ""
        args.batch = args.bytes_batch = 2
        args.size = args.bytes_size = 32
    peak_batches = [int(b) for b in args.peak_batches.split(",") if b]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.table:
        print(markdown_table(json.loads(Path(args.table).read_text())))
        return 0
    if args.bits:
        bench_bits(args.repeats)
        return 0
    if args.kernels:
        results = {"settings": vars(args), "torch": torch.__version__, "kernels": bench_kernels(args.repeats)}
        print(f"\nwrote {_write(args.out, results)}")
        return 0
    results: dict = {"settings": vars(args), "torch": torch.__version__, "models": {}}
    for name in args.models.split(","):
        model = MODELS[name]()
        batch = torch.randn(args.batch, 3, args.size, args.size)
        bytes_batch = torch.randn(args.bytes_batch, 3, args.bytes_size, args.bytes_size)
        if args.bytes_mode == "real" and (args.bytes_batch, args.bytes_size) == (args.batch, args.size):
            bytes_batch = batch
        rows = []
        for case in args.cases.split(","):
            row = bench_case(model, batch, case, args.repeats, args.bytes_mode, bytes_batch, peak_batches)
            row["reference_saved_ratio"] = REFERENCE.get(name, {}).get(case)
            rows.append(row)
            print(_format_row(name, row), flush=True)
        results["models"][name] = rows
        _write(args.out, results)  # after each model: a long run leaves what it measured
    for name in filter(None, args.gpts.split(",")):
        model, batch = gpt_model(name)
        rows = []
        for case in GPT_CASES:
            row = bench_gpt_case(model, batch, case, args.repeats)
            rows.append(row)
            print(_format_row(name, row), flush=True)
        results["models"][name] = rows
    print(f"\nwrote {_write(args.out, results)}")
    return 0


def _write(path: str, results: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


HEADER = (
    f"{'model':18s} {'case':19s} {'stock saved MB':>14s} {'saved ours/stock':>16s} "
    f"{'reference':>9s} {'peak ours/stock':>15s} {'time ours/stock [q1..q3] min':>30s} "
    f"{'AdamW steady peak ours/stock by batch (max first-step)':>56s}"
)


def _format_row(model: str, row: dict) -> str:
    if not getattr(_format_row, "printed", False):
        print(HEADER)
        _format_row.printed = True  # type: ignore[attr-defined]
    ref = row["reference_saved_ratio"]
    by_batch = " ".join(f"b{b}:{r:.3f}" for b, r in row.get("peak_ratio_adamw", {}).items())
    first = row.get("first_step_peak_ratio_adamw")
    if first:
        by_batch += f" ({max(first.values()):.3f})"
    timing = ""
    if "time_ratio" in row:
        timing = (
            f"{row['time_ratio']:.3f} [{row['time_ratio_q1']:.3f}..{row['time_ratio_q3']:.3f}]"
            f" {row['time_ratio_min']:.3f}"
        )
    return (
        f"{model:18s} {row['case']:19s} {row['stock_saved_bytes'] / 2**20:14.1f} "
        f"{row['saved_ratio']:16.3f} {('' if ref is None else f'{ref:.3f}'):>9s} "
        f"{row['peak_ratio']:15.3f} {timing:>30s} {by_batch:>56s}"
    )


def markdown_table(results: dict) -> str:
    """The docs' table from a results JSON (``--table``)."""
    lines = [
        "| model | case | stock saved MB | saved ours/stock | reference | peak ours/stock "
        "| time ours/stock: median [q1..q3] | min/min | AdamW steady-state peak ours/stock, "
        "batch 1 / 2 / 8 / 32 | first-step peak, max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in results["models"].items():
        for row in rows:
            ref = row.get("reference_saved_ratio")
            steady = row.get("peak_ratio_adamw") or {}
            first = row.get("first_step_peak_ratio_adamw") or {}
            timing = minimum = ""
            if "time_ratio" in row:
                timing = f"{row['time_ratio']:.3f} [{row['time_ratio_q1']:.3f}..{row['time_ratio_q3']:.3f}]"
                minimum = f"{row['time_ratio_min']:.3f}"
            lines.append(
                f"| {model} | {row['case']} | {row['stock_saved_bytes'] / 2**20:.1f} "
                f"| {row['saved_ratio']:.3f} | {'' if ref is None else f'{ref:.3f}'} "
                f"| {row['peak_ratio']:.3f} | {timing} | {minimum} "
                f"| {' / '.join(f'{v:.3f}' for v in steady.values())} "
                f"| {f'{max(first.values()):.3f}' if first else ''} |"
            )
    return "\n".join(lines)


def bench_bits(repeats: int) -> dict:
    """Mask packing side by side: numpy's packbits/unpackbits (the CPU path of
    ``memsave_nb.layers._bits``) against the torch-op path (what runs under dispatch modes,
    compilers and on other devices), on ReLU-sized masks; minima of ``repeats`` runs."""
    from memsave_nb.layers import _bits

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(max(3, repeats)):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return min(times)

    rows = {}
    for numel in (451_584, 1_204_224, 3_211_264):
        out = torch.relu(torch.randn(numel))
        mask = out.bool()
        shape = (numel,)
        packed = _bits.pack_bits(mask)
        timings: dict[str, float] = {}
        for label in ("numpy", "torch"):
            saved = _bits.np
            if label == "torch":
                _bits.np = None  # type: ignore[assignment]
            try:
                timings[f"{label}_pack"] = best(lambda: _bits.pack_bits(mask))
                timings[f"{label}_unpack"] = best(lambda: _bits.unpack_bits(packed, shape, torch.uint8))
                timings[f"{label}_relu6_mask_pack"] = best(
                    lambda: (
                        _bits.pack_inside(out, 0.0, 6.0)
                        if _bits.np is not None
                        else _bits.pack_bits((out > 0) & (out < 6))
                    )
                )
            finally:
                _bits.np = saved
        rows[str(numel)] = timings
        print(
            f"{numel:>9d} elements: "
            + ", ".join(
                f"{what} torch/numpy {timings['torch_' + what] / timings['numpy_' + what]:.2f}"
                f" ({timings['numpy_' + what] * 1e6:.0f} us numpy)"
                for what in ("pack", "unpack", "relu6_mask_pack")
            ),
            flush=True,
        )
    return rows


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory (no trimming, no mmap up to 32 MiB): otherwise, with each
    call making its own output, whichever call comes after a free pays the page faults of
    fresh memory, an order effect of several times the kernel's time. A training step in
    steady state takes no page faults (measured), so this is the step's condition."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its maximum on 64-bit)
    except (OSError, AttributeError):  # not glibc: left as it is
        pass


def bench_kernels(repeats: int) -> dict:
    """The fused C kernels (``memsave_nb.layers._native``) at every SIMD level this CPU has,
    beside the stock op each one replaces or adds to, on ReLU-sized float32 tensors (the
    largest ResNet-18 map at 4 x 112^2 and at the paper's 8 x 224^2), every call making its
    own output as in a step: ReLU + mask in one pass against ``relu``; the mask pack alone
    against ``relu`` (what a held output's mask adds); the masked backward against
    ``threshold_backward`` on the kept output; the scaling backward of leaky ReLU and dropout
    against ``leaky_relu_backward`` and ``grad * noise``; leaky ReLU's input mask against the
    numpy comparison and ``packbits`` it replaces. Medians of interleaved runs, ratios."""
    import numpy as np

    from memsave_nb.layers import _native

    _keep_freed_memory()
    top = _native.simd_level()
    if top < 0:
        print("no C kernels here (no compiler, or MEMSAVE_NB_NATIVE=0)")
        return {}
    what = {
        "relu_pack": ("ReLU + mask", "relu"),
        "pack_nonzero": ("mask alone", "relu"),
        "select_bits": ("masked backward", "threshold_backward"),
    }
    # the leaky ReLU's and dropout's backward (scale_bits): timed at the CPU's best level only
    plain_what = {
        "scale_bits leaky": ("leaky ReLU backward", "leaky_relu_backward"),
        "scale_bits dropout": ("dropout backward", "grad * noise"),
        "pack_positive": ("leaky ReLU mask", "numpy greater + packbits"),
    }
    rows: dict = {}
    try:
        for shape in ((4, 64, 56, 56), (8, 64, 112, 112)):
            x = torch.randn(shape)
            out = torch.relu(x)
            grad = torch.randn(shape)
            packed = _native.pack_nonzero(out)
            noise = (out != 0).to(torch.float32).mul_(2.0)
            stock = {
                "relu": lambda: torch.relu(x),
                "threshold_backward": lambda: torch.ops.aten.threshold_backward(grad, out, 0),
                "leaky_relu_backward": lambda: torch.ops.aten.leaky_relu_backward(grad, x, 0.01, False),
                "grad * noise": lambda: grad * noise,
                # (not stock: what the layer ran before the kernel, and runs without it)
                "numpy greater + packbits": lambda: np.packbits(np.greater(x.numpy(), 0), bitorder="little"),
            }
            plain = {
                "scale_bits leaky": lambda: _native.scale_bits(grad, packed, 1.0, 0.01),
                "scale_bits dropout": lambda: _native.scale_bits(grad, packed, 2.0, 0.0),
                "pack_positive": lambda: _native.pack_positive(x),
            }
            ours = {
                "relu_pack": lambda: _native.relu_pack(x, False),
                "pack_nonzero": lambda: _native.pack_nonzero(out),
                "select_bits": lambda: _native.select_bits(grad, packed),
            }
            times: dict[str, list[float]] = {}
            for _ in range(max(5, repeats)):
                for level in range(top + 1):
                    _native.simd_level(level)
                    for k, fn in ours.items():
                        start = time.perf_counter()
                        fn()
                        times.setdefault(f"{_native.SIMD_NAMES[level]} {k}", []).append(time.perf_counter() - start)
                for prefix, fns in (("stock", stock), ("plain", plain)):
                    for k, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        times.setdefault(f"{prefix} {k}", []).append(time.perf_counter() - start)
            med = {label: statistics.median(v) for label, v in times.items()}
            row: dict = {"us": {label: v * 1e6 for label, v in med.items()}}
            print(
                f"{'x'.join(map(str, shape))} float32 ({x.numel():,} elements), "
                f"microseconds, median of {max(5, repeats)}:"
            )
            for k, (label, base_name) in what.items():
                base = med[f"stock {base_name}"]
                cells = []
                for level in range(top + 1):
                    name = _native.SIMD_NAMES[level]
                    mine = med[f"{name} {k}"]
                    row[f"{name} {k} / stock {base_name}"] = mine / base
                    cells.append(f"{name} {mine * 1e6:.0f} ({mine / base:.2f}x)")
                print(f"  {label} vs {base_name} {base * 1e6:.0f}: " + ", ".join(cells))
            for k, (label, base_name) in plain_what.items():
                base, mine = med[f"stock {base_name}"], med[f"plain {k}"]
                row[f"{k} / stock {base_name}"] = mine / base
                print(f"  {label} vs {base_name} {base * 1e6:.0f}: {mine * 1e6:.0f} ({mine / base:.2f}x)")
            rows["x".join(map(str, shape))] = row
    finally:
        _native.simd_level(2)  # back to the CPU's best
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
