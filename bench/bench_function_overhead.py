"""What running a layer as a custom autograd Function costs, beside stock's native node.

Why this exists: at small inputs (4 x 112^2) the converted ResNets stay 5-10% slower than stock
in the frozen-weight cases, and the obvious next step was to move the layers from Python
autograd Functions to compiled C++ ones (``torch::autograd::Function``). This script measures
whether that would help, before anyone builds it. In one run, interleaved in random order:

1. **One activation** between a frozen 1x1 conv and a trainable one (which keeps the
   activation's output, so no mask is needed): stock ``relu`` (autograd's native
   ``ReluBackward0``), a bare Python Function doing exactly what stock does (``relu``, save the
   output, ``threshold_backward``), the same Function compiled in C++ (``--cpp``), and
   ``MemSaveReLU``. Forward and backward medians, at 8 elements and at ResNet-sized tensors,
   with the minor page faults per step (fresh heap memory the kernel zero-fills on first touch).
2. **ResNet-18, every parameter frozen, input gradient** (the bench's ``input`` case) at
   4 x 112^2, with only the convolutions swapped: stock, ``MemSaveConv2d``, a bare Python
   frozen-weight conv Function (keep the weight, adjoint convolution in backward) and its C++
   twin (``--cpp``). Median of per-pair ratios to stock.

``--cpp`` compiles a small torch extension (``torch.utils.cpp_extension.load_inline``; about
40 s on 2 cores, needs a C++ compiler and torch's headers), cached by torch for later runs.

    python bench/bench_function_overhead.py            # Python Functions only
    python bench/bench_function_overhead.py --cpp      # with the compiled C++ twins
    python bench/bench_function_overhead.py --quick --out /tmp/fo.json   # smoke test: tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layers import _step_seconds, apply_case, resnet  # noqa: E402
from memsave_nb.layers import convert  # noqa: E402

_CPP = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BareRelu : public torch::autograd::Function<BareRelu> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x) {
    auto out = at::relu(x);
    ctx->save_for_backward({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto out = ctx->get_saved_variables()[0];
    return {at::threshold_backward(grads[0], out, 0)};
  }
};

struct FrozenConv : public torch::autograd::Function<FrozenConv> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, at::Tensor w,
                            std::vector<int64_t> stride, std::vector<int64_t> padding,
                            int64_t groups) {
    ctx->save_for_backward({w});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["x_shape"] = x.sizes().vec();
    return at::convolution(x, w, {}, stride, padding, {1, 1}, false, {0, 0}, groups);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto w = ctx->get_saved_variables()[0];
    auto stride = ctx->saved_data["stride"].toIntVector();
    auto padding = ctx->saved_data["padding"].toIntVector();
    auto x_shape = ctx->saved_data["x_shape"].toIntVector();
    auto grad = grads[0];
    std::vector<int64_t> extra;
    for (int d = 0; d < 2; d++) {
      extra.push_back(x_shape[2 + d] - ((grad.size(2 + d) - 1) * stride[d] - 2 * padding[d]
                                        + w.size(2 + d)));
    }
    auto grad_x = at::convolution(grad, w, {}, stride, padding, {1, 1}, true, extra,
                                  ctx->saved_data["groups"].toInt());
    return {grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor bare_relu(at::Tensor x) { return BareRelu::apply(x); }
at::Tensor frozen_conv(at::Tensor x, at::Tensor w, std::vector<int64_t> stride,
                       std::vector<int64_t> padding, int64_t groups) {
  return FrozenConv::apply(x, w, stride, padding, groups);
}
"""


def build_cpp() -> Any:
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "memsave_nb_bench_overhead", cpp_sources=_CPP, functions=["bare_relu", "frozen_conv"], extra_cflags=["-O2"]
    )


class _BareRelu(torch.autograd.Function):
    """Stock's ReLU, as a Python Function: the floor of any Python layer's cost."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = torch.relu(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0)


class _BareFrozenConv(torch.autograd.Function):
    """A frozen-weight conv keeping the weight only, input gradient by the adjoint conv."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, stride: list[int], padding: list[int], groups: int) -> Tensor:
        ctx.save_for_backward(w)
        ctx.args = (stride, padding, groups, x.shape)
        return torch.convolution(x, w, None, stride, padding, [1, 1], False, [0, 0], groups)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (w,) = ctx.saved_tensors
        stride, padding, groups, x_shape = ctx.args
        extra = [
            x_shape[2 + d] - ((grad.shape[2 + d] - 1) * stride[d] - 2 * padding[d] + w.shape[2 + d]) for d in range(2)
        ]
        grad_x = torch.convolution(grad, w, None, stride, padding, [1, 1], True, extra, groups)
        return grad_x, None, None, None, None


class _Swapped(nn.Module):
    def __init__(self, fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


def _frozen_conv_class(call: Callable[..., Tensor]) -> type:
    class FrozenConv(nn.Conv2d):
        def forward(self, x: Tensor) -> Tensor:
            if self.weight.requires_grad or not x.requires_grad or self.bias is not None:
                return super().forward(x)
            return call(x, self.weight, list(self.stride), list(self.padding), self.groups)

    return FrozenConv


def _interleaved(steps: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list]:
    """Each step ``repeats`` times, every round in a fresh random order (drift hits all)."""
    results: dict[str, list] = {k: [] for k in steps}
    for step in steps.values():  # warm-up
        step()
        step()
    for _ in range(repeats):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            results[name].append(step())
    return results


def activation_overhead(shape: tuple[int, ...], repeats: int, cpp: Any) -> dict:
    c = shape[1]
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 1))
    stock.requires_grad_(False)
    stock[2].weight.requires_grad_(True)  # keeps its input: the activation needs no mask
    models = {"stock": stock}
    variants = {"python_function": lambda x: _BareRelu.apply(x)}
    if cpp is not None:
        variants["cpp_function"] = cpp.bare_relu
    for name, fn in variants.items():
        model = copy.deepcopy(stock)
        model[1] = _Swapped(fn)
        models[name] = model
    models["memsave"] = copy.deepcopy(stock)
    convert(models["memsave"], include=["1"])
    x0 = torch.randn(shape)

    def step(model: nn.Module) -> tuple[float, float, int]:
        x = x0.clone().requires_grad_(True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        loss = model(x).sum()
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        model.zero_grad(set_to_none=True)
        return mid - start, end - mid, faults

    runs = _interleaved({k: (lambda m=m: step(m)) for k, m in models.items()}, repeats)
    row: dict = {"shape": list(shape), "elements": int(torch.Size(shape).numel())}
    for name, values in runs.items():
        fwd = statistics.median(v[0] for v in values) * 1e6
        bwd = statistics.median(v[1] for v in values) * 1e6
        row[name] = {
            "forward_us": fwd,
            "backward_us": bwd,
            "minor_faults_per_step": statistics.median(v[2] for v in values),
        }
    for name in runs:
        if name != "stock":
            row[name]["forward_extra_us"] = row[name]["forward_us"] - row["stock"]["forward_us"]
            row[name]["backward_extra_us"] = row[name]["backward_us"] - row["stock"]["backward_us"]
    return row


def resnet_conv_overhead(repeats: int, cpp: Any, batch: int, size: int) -> dict:
    torch.manual_seed(0)
    stock = resnet(18)
    input_grad = apply_case(stock, "input")
    models = {"stock": stock}
    memsave = copy.deepcopy(stock)
    convert(memsave, include=[n for n, m in memsave.named_modules() if isinstance(m, nn.Conv2d)])
    models["memsave"] = memsave
    calls = {"python_function": _BareFrozenConv.apply}
    if cpp is not None:
        calls["cpp_function"] = cpp.frozen_conv
    for name, call in calls.items():
        model = copy.deepcopy(stock)
        cls = _frozen_conv_class(call)
        for module in model.modules():
            if type(module) is nn.Conv2d:
                module.__class__ = cls
        models[name] = model
    x0 = torch.randn(batch, 3, size, size)
    runs = _interleaved({k: (lambda m=m: _step_seconds(m, x0, input_grad)) for k, m in models.items()}, repeats)
    row: dict = {"batch": batch, "size": size, "stock_step_seconds": statistics.median(runs["stock"])}
    for name, values in runs.items():
        if name == "stock":
            continue
        ratios = [v / s for v, s in zip(values, runs["stock"])]
        q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        row[name] = {"time_ratio": med, "q1": q1, "q3": q3, "min_over_min": min(values) / min(runs["stock"])}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cpp", action="store_true", help="also build and time the C++ autograd Function twins (~40 s build)"
    )
    parser.add_argument("--repeats", type=int, default=101, help="rounds for the activation")
    parser.add_argument("--model-repeats", type=int, default=21, help="rounds for ResNet-18")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: the 8-element activation only, ResNet-18 at 2 x 32^2, 2 rounds",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "function_overhead.json"))
    args = parser.parse_args(argv)
    shapes = [(1, 8, 4, 4), (4, 64, 28, 28), (4, 64, 56, 56)]
    batch, size = 4, 112
    if args.quick:  # two rounds: the ResNet ratios' quartiles need two
        args.repeats, args.model_repeats, shapes, batch, size = 2, 2, shapes[:1], 2, 32
    torch.set_num_threads(args.threads)
    random.seed(0)
    cpp = build_cpp() if args.cpp else None
    results: dict = {"settings": vars(args), "torch": torch.__version__, "activation": []}
    print("one activation, forward / backward extra over stock's native node (us), median; minor page faults per step")
    for shape in shapes:
        row = activation_overhead(shape, args.repeats, cpp)
        results["activation"].append(row)
        parts = [
            f"stock {row['stock']['forward_us']:.0f}/{row['stock']['backward_us']:.0f} us"
            f" ({row['stock']['minor_faults_per_step']:.0f} faults)"
        ]
        for name, values in row.items():
            if isinstance(values, dict) and name != "stock":
                parts.append(
                    f"{name} {values['forward_extra_us']:+.0f}/"
                    f"{values['backward_extra_us']:+.0f}"
                    f" ({values['minor_faults_per_step']:.0f})"
                )
        print(f"  {str(tuple(shape)):18s} " + "  ".join(parts), flush=True)
    row = resnet_conv_overhead(args.model_repeats, cpp, batch, size)
    results["resnet18_input_convs"] = row
    print(
        f"ResNet-18 'input' at {batch} x {size}^2, convs swapped only (stock step "
        f"{row['stock_step_seconds'] * 1e3:.0f} ms CPU): time / stock, median [q1..q3] min/min"
    )
    for name, values in row.items():
        if isinstance(values, dict):
            print(
                f"  {name:16s} {values['time_ratio']:.3f} [{values['q1']:.3f}.."
                f"{values['q3']:.3f}] {values['min_over_min']:.3f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
