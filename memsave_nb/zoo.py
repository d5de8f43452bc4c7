"""Built-in demo workloads: pure torch, seeded, sized for a few tenths of a second per step here.

``make(name)`` returns a ready :class:`~memsave_nb.workload.Workload`:

- ``"cnn"``: a ResNet-style network (conv, batch norm, ReLU, max-pool, residual blocks, linear head);
- ``"gpt"``: a GPT-style decoder (embedding, causal attention through
  ``scaled_dot_product_attention``, GELU MLP, LayerNorm, dropout); ``model.blocks`` holds the
  repeated blocks, ``model.head`` the output layer;
- ``"mlp"``: a small multilayer perceptron;
- ``"gpt-7b"``: a Llama-7B-shaped decoder (32 layers, d=4096, bf16, batch 1, sequence 2048) built
  under ``FakeTensorMode``: it only runs in ``mode="fake"``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import WorkloadError, quoted
from .workload import Workload, check_device


# -- CNN ------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (projected) skip connection, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + identity)


class ResNetLike(nn.Module):
    """A small ResNet: stem, ``len(widths)`` stages of ``blocks`` BasicBlocks, pooled linear head."""

    def __init__(
        self, widths: tuple[int, ...] = (32, 64, 128), blocks: int = 2, num_classes: int = 10, in_channels: int = 3
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stage = [BasicBlock(cin, w, stride=1 if i == 0 else 2)] + [BasicBlock(w, w) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            cin = w
        self.layers = nn.ModuleList(stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, classes)
        x = self.stem(x)
        for stage in self.layers:
            x = stage(x)
        return self.head(torch.flatten(self.pool(x), 1))


# -- GPT ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_hidden: int | None = None  # default 4 * n_embd
    dropout: float = 0.1
    bias: bool = True
    mlp: str = "gelu"  # "gelu" (GPT-2) or "swiglu" (Llama)
    norm: str = "layernorm"  # "layernorm" or "rmsnorm"


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.RMSNorm(cfg.n_embd) if cfg.norm == "rmsnorm" else nn.LayerNorm(cfg.n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        B, T, C = x.shape
        # chunk and -1 (not split(C) and n_head): under tensor parallel this rank's qkv output holds
        # 3C / tp features; unsharded they are the same views as split(C) and view(B, T, nh, hs)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_hidden or 4 * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_hidden or 4 * cfg.n_embd
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.act = nn.SiLU()
        self.down = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class DecoderOutput:
    """Hugging Face style output: the default loss reads ``.loss``."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = _norm(cfg)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(
                    p,
                    0.0,
                    0.02 / (math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "down.weight")) else 1.0),
                )

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:  # idx: (B, T) -> (B, T, C), before the head
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> DecoderOutput:  # idx: (B, T)
        logits = self.head(self.hidden_states(idx))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return DecoderOutput(loss=loss, logits=logits)


# -- MLP ------------------------------------------------------------------------------------------
def mlp(sizes: tuple[int, ...] = (784, 1024, 1024, 512, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# -- registry -------------------------------------------------------------------------------------
GPT_7B = GPTConfig(
    vocab_size=32000,
    block_size=2048,
    n_layer=32,
    n_head=32,
    n_embd=4096,
    mlp_hidden=11008,
    dropout=0.0,
    bias=False,
    mlp="swiglu",
    norm="rmsnorm",
)


@contextlib.contextmanager
def _seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _cnn(batch_size: int, seed: int, device: str) -> Workload:
    with _seeded(seed):
        model = ResNetLike().to(device)
        x = torch.randn(batch_size, 3, 32, 32, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
    return Workload(model, x, loss=lambda out: F.cross_entropy(out, y), device=device, name="cnn")


def _gpt(batch_size: int, seed: int, device: str, cfg: GPTConfig = GPTConfig()) -> Workload:
    with _seeded(seed):
        model = GPT(cfg).to(device)
        idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), device=device)
        targets = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size), device=device)
    return Workload(model, {"idx": idx, "targets": targets}, device=device, name="gpt")


def _mlp(batch_size: int, seed: int, device: str) -> Workload:
    with _seeded(seed):
        model = mlp().to(device)
        x = torch.randn(batch_size, 784, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    loss.targets = y  # type: ignore[attr-defined] # the labels, for a loss per micro-batch (report --pp)
    return Workload(model, x, loss=loss, device=device, name="mlp")


def _gpt_7b(batch_size: int, seed: int, device: str) -> Workload:
    """Built under FakeTensorMode: parameters have shapes and dtypes but no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = GPT_7B
    fake_mode = FakeTensorMode()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: no float32 copy, no .to()
    try:
        with fake_mode, _seeded(seed):
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)

    def batch() -> dict[str, torch.Tensor]:  # called by measure() inside the fake mode
        idx = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size))
        return {"idx": idx, "targets": idx.roll(-1, dims=1)}

    return Workload(model, batch, device=device, name="gpt-7b")


DEFAULT_BATCH = {"cnn": 32, "gpt": 8, "mlp": 256, "gpt-7b": 1}
_BUILDERS: dict[str, Callable[..., Workload]] = {"cnn": _cnn, "gpt": _gpt, "mlp": _mlp, "gpt-7b": _gpt_7b}
NAMES = tuple(_BUILDERS)


def make(name: str, batch_size: int | None = None, *, seed: int = 0, device: str = "cpu") -> Workload:
    """A demo workload by name; an unknown name is a one-line error listing the known ones."""
    if name not in _BUILDERS:
        raise WorkloadError(f"unknown demo model {quoted(name)}; choose from {', '.join(NAMES)}")
    device = check_device(device)  # before building: a missing GPU is a one-line error, not an assert
    return _BUILDERS[name](batch_size or DEFAULT_BATCH[name], seed, device)


def gpt(config: GPTConfig | None = None, batch_size: int = 8, *, seed: int = 0, device: str = "cpu") -> Workload:
    """A GPT-style workload with a custom config (e.g. a GPT-2-small shape for fake mode)."""
    device = check_device(device)
    return _gpt(batch_size, seed, device, config or GPTConfig())
