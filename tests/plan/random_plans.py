"""Random plans over small float64 models, and the stock gradients they must reproduce.

Used by ``test_plan_property.py``. A seeded generator (not hypothesis): every CI run checks the
same few hundred plans, and a failure prints the seed and the plan's JSON to replay it.

The oracle is the stock model itself: every parameter trainable, the input requiring grad, only
the plan's *semantic* choices applied (batch norm in eval mode). Freezing, memory-saving layers
and checkpointing must not change any gradient that is still computed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from memsave_nb import zoo
from memsave_nb.checkpointing import POLICY_PRESETS, PlanError
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.workload import Workload


# -- models (small: one case must take milliseconds) ------------------------------------------
class CNN(nn.Module):
    """Conv, batch norm, ReLU (in-place too), LeakyReLU, ReLU6, max-pool, dropout (2-d too),
    linear; a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1, bias=False),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 1),
            nn.LeakyReLU(0.1),
            nn.Dropout2d(0.2),
            nn.Conv2d(4, 4, 1),
            nn.ReLU6(),
        )
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2, 6, 6)
        x = self.stem(x)
        x = x + self.block(x)
        return self.head(self.drop(torch.flatten(self.pool(x), 1)))


def mlp_bn() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.LeakyReLU(0.2),
        nn.Dropout(0.3),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 2),
    )


class TransformerBlock(nn.Module):
    """Pre-norm block: RMSNorm, multi-head attention, LayerNorm, GELU MLP with dropout."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * d, d))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.out(x)


GPT_CONFIG = zoo.GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.1)


def _workload(model: nn.Module, x: torch.Tensor, target: torch.Tensor, name: str) -> Workload:
    return Workload(
        model,
        x,
        loss=lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)),
        optimizer=None,
        name=name,
    )


def _build(name: str) -> Workload:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "cnn":
            model, x, y = CNN(), torch.randn(3, 2, 6, 6), torch.randint(0, 3, (3,))
        elif name == "mlp_bn":
            model, x, y = mlp_bn(), torch.randn(5, 6), torch.randint(0, 2, (5,))
        elif name == "transformer":
            model, x, y = TransformerBlock(), torch.randn(2, 4, 8), torch.randint(0, 3, (2, 4))
        elif name == "gpt":
            model = zoo.GPT(GPT_CONFIG).double()
            idx = torch.randint(0, GPT_CONFIG.vocab_size, (2, GPT_CONFIG.block_size))
            return Workload(model, {"idx": idx, "targets": idx.roll(-1, dims=1)}, optimizer=None, name="gpt")
        else:
            raise KeyError(name)
        return _workload(model.double(), x.double(), y, name)


MODELS = ("cnn", "mlp_bn", "transformer", "gpt")


# -- random plans --------------------------------------------------------------------------------
# ops a custom selective policy may name: some each model runs, some it never runs
OPS = (
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.convolution",
    "aten.native_batch_norm",
    "aten._native_batch_norm_legit",
    "aten.native_layer_norm",
    "aten.relu",
    "aten.leaky_relu",
    "aten.gelu",
    "aten.mul",
    "aten.add",
    "aten.gt",
    "aten.max_pool2d_with_indices",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._softmax",
    "aten.bernoulli",
    "aten.native_dropout",
    "aten.clone",
    "aten.view",
    "aten.rsqrt",
    "aten.mean",
    "aten.pow",
    "aten.embedding",
    "aten.sub",
    "aten.div",
)


def random_policy(rng: random.Random) -> Any:
    kind = rng.choice(["preset", "full", "selective", "selective", "selective"])
    if kind == "preset":
        return rng.choice(sorted(POLICY_PRESETS))
    if kind == "full":
        return {"kind": "full"}
    ops = {op: rng.choice(["save", "recompute"]) for op in rng.sample(OPS, rng.randint(0, 5))}
    return {"kind": "selective", "ops": ops, "default": rng.choice(["save", "recompute"])}


def random_plan(rng: random.Random, model: nn.Module) -> dict[str, Any]:
    """A random plan's fields (construction may refuse them: that is part of the test)."""
    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    names = modules + params + ["*", "*.bias", "*.weight"]
    called = [n for n, m in model.named_modules() if not isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    frozen = rng.sample(names, rng.choice([0, 0, 1, 2, 3]))
    if rng.random() < 0.3:
        frozen = ["*"]
    trainable = rng.sample(names, rng.choice([0, 0, 1, 2]))
    memsave_choice = rng.random()
    memsave = ["*"] if memsave_choice < 0.5 else rng.sample(modules, rng.randint(0, 3))
    regions = {n: random_policy(rng) for n in rng.sample(called, rng.choice([0, 1, 1, 2, 3]))}
    bn_eval: list[str] = []
    if norms and rng.random() < 0.4:
        bn_eval = ["*"] if rng.random() < 0.5 else rng.sample(norms, 1)
    return dict(
        frozen=frozen,
        trainable=trainable,
        memsave=memsave,
        regions=regions,
        bn_eval=bn_eval,
        input_requires_grad=rng.choice([None, True, False]),
    )


# -- running -------------------------------------------------------------------------------------
def step_gradients(workload: Workload, plan: Plan, seed: int) -> dict[str, torch.Tensor]:
    """One forward and backward under ``plan``: gradients by parameter name and ``"<input>"``."""
    model = workload.model
    with plan.apply(workload) as w:
        torch.manual_seed(seed)
        batch = w.make_batch()
        w.compute_loss(w.forward(batch)).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if isinstance(batch, torch.Tensor) and batch.grad is not None:
            grads["<input>"] = batch.grad.detach().clone()
        for p in model.parameters():
            p.grad = None
    return grads


@dataclass
class Outcome:
    checked: int = 0
    refused: int = 0
    skipped: int = 0  # nothing to differentiate
    memsave_and_save_default: int = 0  # checked plans with both (the wrong-gradient case)
    compared_tensors: int = 0


class Checker:
    """Stock gradients cached per batch-norm choice; plans compared against them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.workload = _build(name)
        self._ref: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}

    def reference(self, bn_eval: tuple[str, ...]) -> dict[str, torch.Tensor]:
        if bn_eval not in self._ref:
            self._ref[bn_eval] = step_gradients(
                self.workload, Plan(trainable=["*"], input_requires_grad=True, bn_eval=bn_eval), seed=1
            )
        return self._ref[bn_eval]

    def differentiates(self, plan: Plan) -> bool:
        """False when the plan leaves nothing to differentiate (the step itself would refuse)."""
        if plan.trainable_parameter_names(self.workload.model):
            return True
        wants = plan.input_requires_grad if plan.input_requires_grad is not None else self.workload.input_requires_grad
        return bool(wants) and isinstance(self.workload.batch, torch.Tensor)

    def check(self, fields: dict[str, Any], outcome: Outcome, on_refusal: Callable[[PlanError], None]) -> None:
        """Build the plan and run it: a refusal must be a PlanError leaving the model as it was;
        an accepted plan must give the stock gradients of what it leaves trainable."""
        model = self.workload.model
        before = ModelSnapshot.capture(model)
        try:
            plan = Plan(**fields)
            if not self.differentiates(plan):
                outcome.skipped += 1
                return
            got = step_gradients(self.workload, plan, seed=1)
        except PlanError as exc:
            on_refusal(exc)
            outcome.refused += 1
            assert before.differences(model) == [], "a refused plan changed the model"
            return
        assert before.differences(model) == [], before.differences(model)
        ref = self.reference(plan.bn_eval)
        trainable = set(plan.trainable_parameter_names(model))
        input_grad = (
            plan.input_requires_grad if plan.input_requires_grad is not None else self.workload.input_requires_grad
        )
        expected = {n for n in ref if n in trainable or (n == "<input>" and input_grad)}
        assert set(got) == expected, sorted(set(got) ^ expected)
        for n in expected:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}: {m}")
            outcome.compared_tensors += 1
        outcome.checked += 1
        if plan.memsave and any(
            p.default.value == "save" and p.kind.value == "selective" for p in plan.active_regions.values()
        ):
            outcome.memsave_and_save_default += 1
