"""Workloads for the engine tests, as data: each case builds a fresh, seeded Workload.

The awkward models each stress one thing the tracker must count right: a skip connection, a
module called twice, an in-place ReLU, views, a checkpointed block, a selective-checkpointing
block that keeps matmuls, frozen layers, a Hugging Face style dict batch, an input that
requires grad. Sizes are tiny: the suite runs every case several times.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memsave_nb import zoo
from memsave_nb.workload import Workload

aten = torch.ops.aten


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Workload]
    all_trainable: bool = True  # MemTracker (torch 2.13) raises as soon as a parameter is frozen
    targets: bool = False  # the loss closure holds a pre-existing target tensor (``wl.loss.targets``)

    def __str__(self) -> str:
        return self.name


def _seeded(fn: Callable[[], Workload]) -> Callable[[], Workload]:
    @functools.wraps(fn)
    def build() -> Workload:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return fn()

    return build


def _ce_loss(y: torch.Tensor) -> Callable:
    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    loss.targets = y  # type: ignore[attr-defined]  # lets oracles count the target like the tracker
    return loss


# -- awkward models ---------------------------------------------------------------------------------
class Skip(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = x + self.fc2(self.act(self.fc1(x)))  # skip connection
        return self.out(h + self.fc1(h))  # and fc1 reused on the sum


class Reused(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.shared = nn.Linear(d, d)  # called twice per forward
        self.act = nn.Tanh()
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.act(self.shared(self.inp(x)))
        h = self.act(self.shared(h))
        return self.head(h)


class InplaceReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.relu(self.bn(self.conv1(x)))
        x = self.relu2(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class Views(nn.Module):
    """Reshapes, transposes, a permute, a chunk and a contiguous copy: views share storages."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(48, 4)

    def forward(self, x):  # (B, 6, 8)
        B = x.shape[0]
        h = self.proj(x)  # (B, 6, 24)
        a, b, c = h.chunk(3, dim=-1)  # views of h
        h = (a * b + c).transpose(1, 2)  # (B, 8, 6) view
        h = self.mix(h).permute(0, 2, 1).contiguous()  # (B, 6, 8) copy
        return self.head(h.reshape(B, -1)[:, :48].view(B, 48))


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Checkpointed(nn.Module):
    """The middle block runs under ``checkpoint(use_reentrant=False)``, optionally with a SAC policy."""

    def __init__(self, d: int = 32, policy: Callable | None = None, use_checkpoint: bool = True):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.inp = nn.Linear(16, d)
        self.block = _Block(d)
        self.head = nn.Linear(d, 4)
        self.policy = policy

    def forward(self, x):
        h = self.inp(x)
        if not self.use_checkpoint:
            h = self.block(h)
        elif self.policy is None:
            h = checkpoint(self.block, h, use_reentrant=False)
        else:
            ctx = functools.partial(create_selective_checkpoint_contexts, self.policy)
            h = checkpoint(self.block, h, use_reentrant=False, context_fn=ctx)
        return self.head(h)


_MATMULS = {aten.mm, aten.addmm, aten.bmm}


def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # op is an OpOverload (aten.addmm.default): compare its packet (CONTEXT.md pitfall)
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class HFStyle(nn.Module):
    """Takes keyword arguments and returns a dict with a ``loss``, like a Hugging Face model."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, labels):
        h = self.norm(self.emb(input_ids)) * attention_mask.unsqueeze(-1)
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


class TiedAndMasked(nn.Module):
    """Tied weights (the head reuses the embedding matrix) and a causal mask kept as a plain tensor
    attribute, not a buffer: the tracker meets it first as an op input and counts it as an input."""

    def __init__(self, vocab: int = 40, d: int = 16, t: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.mask = torch.tril(torch.ones(t, t))  # plain attribute

    def forward(self, idx):
        h = self.emb(idx)  # (B, T, d)
        att = (h @ h.transpose(1, 2)).masked_fill(self.mask == 0, float("-inf")).softmax(-1)
        return self.head(self.mix(att @ h))


# -- builders -----------------------------------------------------------------------------------------
def linear_relu() -> Workload:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return Workload(model, torch.randn(4, 16), name="linear_relu")


def skip() -> Workload:
    y = torch.randint(0, 4, (8,))
    return Workload(Skip(), torch.randn(8, 32), loss=_ce_loss(y), name="skip")


def reused() -> Workload:
    return Workload(Reused(), torch.randn(8, 16), name="reused")


def inplace_relu() -> Workload:
    y = torch.randint(0, 4, (2,))
    return Workload(InplaceReLU(), torch.randn(2, 3, 8, 8), loss=_ce_loss(y), name="inplace_relu")


def views() -> Workload:
    return Workload(Views(), torch.randn(4, 6, 8), name="views")


def checkpointed() -> Workload:
    return Workload(Checkpointed(), torch.randn(8, 16), name="checkpointed")


def eager_block() -> Workload:
    return Workload(Checkpointed(use_checkpoint=False), torch.randn(8, 16), name="eager_block")


def sac_matmuls() -> Workload:
    return Workload(Checkpointed(policy=save_matmuls), torch.randn(8, 16), name="sac_matmuls")


def frozen() -> Workload:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    for p in list(model[0].parameters()) + list(model[2].parameters()):
        p.requires_grad_(False)
    return Workload(model, torch.randn(4, 16), name="frozen")


def frozen_cnn() -> Workload:
    model = InplaceReLU()
    for p in list(model.conv1.parameters()) + list(model.bn.parameters()):
        p.requires_grad_(False)
    y = torch.randint(0, 4, (2,))
    return Workload(model, torch.randn(2, 3, 8, 8), loss=_ce_loss(y), name="frozen_cnn")


def hf_dict() -> Workload:
    batch = {
        "input_ids": torch.randint(0, 50, (2, 6)),
        "attention_mask": torch.ones(2, 6),
        "labels": torch.randint(0, 50, (2, 6)),
    }
    return Workload(HFStyle(), batch, name="hf_dict")


def tied_masked() -> Workload:
    return Workload(TiedAndMasked(), torch.randint(0, 40, (2, 6)), name="tied_masked")


def input_grad() -> Workload:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    for p in model.parameters():
        p.requires_grad_(False)
    return Workload(model, torch.randn(4, 16), input_requires_grad=True, name="input_grad")


def _zoo(name: str, batch: int) -> Callable[[], Workload]:
    def build() -> Workload:
        wl = zoo.make(name, batch)
        return wl

    build.__name__ = f"zoo_{name}"
    return build


CASES: tuple[Case, ...] = (
    Case("linear_relu", _seeded(linear_relu)),
    Case("skip", _seeded(skip), targets=True),
    Case("reused", _seeded(reused)),
    Case("inplace_relu", _seeded(inplace_relu), targets=True),
    Case("views", _seeded(views)),
    Case("eager_block", _seeded(eager_block)),
    Case("checkpointed", _seeded(checkpointed)),
    Case("sac_matmuls", _seeded(sac_matmuls)),
    Case("frozen", _seeded(frozen), all_trainable=False),
    Case("frozen_cnn", _seeded(frozen_cnn), all_trainable=False, targets=True),
    Case("hf_dict", _seeded(hf_dict)),
    Case("input_grad", _seeded(input_grad), all_trainable=False),
    Case("tied_masked", _seeded(tied_masked)),
    Case("zoo_cnn", _zoo("cnn", 2), targets=True),
    Case("zoo_gpt", _zoo("gpt", 1)),
    Case("zoo_mlp", _zoo("mlp", 8), targets=True),
)
CASE_IDS = [c.name for c in CASES]
