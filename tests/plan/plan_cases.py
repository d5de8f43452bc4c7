"""Small workloads for the plan tests: cases as data, each built fresh and seeded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb import zoo
from memsave_nb.workload import Workload

TINY_GPT = zoo.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


class TinyCNN(nn.Module):
    """Conv, batch norm, ReLU, pooling, dropout: every layer type the memsave swaps know."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(2)
        )
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 8, 8)
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.drop(torch.flatten(self.pool(x), 1)))


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class TinyAdapterMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(16, 16) for _ in range(3))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(self.norm(x))


def _seeded(build: Callable[[], Workload]) -> Callable[[], Workload]:
    def make() -> Workload:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build()

    return make


def _cnn() -> Workload:
    model = TinyCNN()
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 5, (4,))
    return Workload(model, x, loss=lambda out: F.cross_entropy(out, y), optimizer="sgd", name="tiny-cnn")


def _adapter() -> Workload:
    model = TinyAdapterMLP()
    return Workload(model, torch.randn(6, 16), optimizer="adamw", name="tiny-adapter")


def _gpt() -> Workload:
    return zoo.gpt(TINY_GPT, batch_size=2, seed=0)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], Workload]


CASES = [Case("cnn", _seeded(_cnn)), Case("adapter", _seeded(_adapter)), Case("gpt", _gpt)]


def layers_available() -> bool:
    try:
        from memsave_nb.layers import convert, revert  # noqa: F401
    except Exception:
        return False
    return True


def gradients(workload: Workload, plan, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward and backward under ``plan``; gradients by parameter name (and ``"<input>"``)."""
    from memsave_nb.measure.compiled import original_model

    with plan.apply(workload) as w:
        torch.manual_seed(seed)
        batch = w.make_batch()
        out = w.forward(batch)
        w.compute_loss(out).backward()
        model = original_model(w.model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if isinstance(batch, torch.Tensor) and batch.grad is not None:
            grads["<input>"] = batch.grad.detach().clone()
    return grads
