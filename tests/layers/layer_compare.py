"""Run a stock module and its memory-saving twin on separate parameter copies and compare."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

TOLERANCE = {
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}


@dataclass
class Result:
    output: Tensor
    grads: dict[str, Tensor | None]
    state: dict[str, Tensor]


def twin(stock: nn.Module, memsave_cls: type[nn.Module]) -> nn.Module:
    """A deep copy of ``stock`` with the memory-saving class: separate parameters."""
    ours = copy.deepcopy(stock)
    ours.__class__ = memsave_cls
    return ours


def run(module: nn.Module, x: Tensor, requires: dict[str, bool], grad_seed: int = 0, **kwargs: Any) -> Result:
    """Forward ``module(x * 1)`` (so an in-place layer never touches a leaf), backward with a
    seeded random output gradient; returns output, gradients of everything that required one."""
    params = dict(module.named_parameters())
    for name, p in params.items():
        p.requires_grad_(requires.get(name, False))
        p.grad = None
    leaf = x.detach().clone().requires_grad_(requires["input"])
    inp = leaf * 1 if leaf.requires_grad else leaf.clone()
    out = module(inp, **kwargs)
    wanted = {"input": leaf} if leaf.requires_grad else {}
    wanted.update({n: p for n, p in params.items() if p.requires_grad})
    grads: dict[str, Tensor | None] = {}
    if wanted and out.requires_grad:
        gen = torch.Generator().manual_seed(grad_seed)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float32).to(out.dtype)
        got = torch.autograd.grad(out, list(wanted.values()), g, allow_unused=True)
        grads = dict(zip(wanted, got))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return Result(out.detach(), grads, state)


def assert_same(a: Result, b: Result, exact_output: bool = True, exact_grads: bool = False) -> None:
    """Outputs, gradients and state equal: bit for bit where asked, else within dtype tolerance."""
    tol = TOLERANCE[a.output.dtype]
    if exact_output:
        torch.testing.assert_close(b.output, a.output, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(b.output, a.output, **tol)
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        ga, gb = a.grads[name], b.grads[name]
        assert (ga is None) == (gb is None), name
        if ga is None or gb is None:
            continue
        assert ga.dtype == gb.dtype and ga.shape == gb.shape, name
        if exact_grads:
            torch.testing.assert_close(gb, ga, rtol=0, atol=0, equal_nan=True, msg=name)
        else:
            torch.testing.assert_close(gb, ga, **TOLERANCE[ga.dtype], msg=name)
    assert a.state.keys() == b.state.keys()
    for name in a.state:
        torch.testing.assert_close(b.state[name], a.state[name], rtol=0, atol=0)
