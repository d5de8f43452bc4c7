"""Optimizers sized by their own state layout: Lion (one moment) and bitsandbytes' blockwise 8-bit
AdamW and Lion, in plain torch, so they run on any device and under ``FakeTensorMode`` (the real
``bitsandbytes.optim.AdamW8bit`` raises ``DataDependentOutputException`` there).

The layout is bitsandbytes 0.50's (``optim/optimizer.py``, ``Optimizer2State.init_state`` and
``Optimizer1State.init_state``): per parameter ``state1`` (and ``state2`` for Adam) of the
parameter's shape in ``uint8``, ``absmax1``/``absmax2`` float32 with one entry per block of 256
elements, ``step`` a Python int; parameters of fewer than 4,096 elements keep float32 states instead;
the two 256-entry float32 quantization maps are shared by every parameter. The step dequantizes
one parameter's states to float32, updates, and quantizes back, as bitsandbytes' CPU kernel does
(``backends/cpu/ops.py``); its CUDA kernel does it in registers, so on CUDA the step's transient
is smaller by about two float32 copies of the largest parameter. Paged variants
(``paged_*``): bitsandbytes pages the state of parameters of 100,000 elements and more to host
memory under pressure; sized here as device memory (an upper bound), see ``docs/trainers.md``.
The quantization maps are uniform grids (the second moment's of fourth roots), not bitsandbytes'
dynamic maps: the same bytes, close enough values for a measured step.

Chosen parameters can keep 32-bit state (``keep_in_32bit``), as bitsandbytes' ``GlobalOptimManager``
override ``{"optim_bits": 32}`` makes them: ``state1``/``state2`` float32, no absmax, no map. The HF
Trainer registers that override for every ``nn.Embedding`` weight when its bitsandbytes optimizer has
``optim_bits=8`` (``create_optimizer``); ``embeddings32=True`` does the same once ``follow_model``
gives it the model (``Workload.make_optimizer`` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["BLOCK", "MIN_8BIT_SIZE", "LayoutOptimizer", "embedding_weights", "state_bytes_per_parameter"]

BLOCK, MIN_8BIT_SIZE = 256, 4096


def state_bytes_per_parameter(numel: int, moments: int, bits: int) -> int:
    """Bytes of one parameter's state in bitsandbytes' layout (without the shared maps and step)."""
    if bits == 32 or numel < MIN_8BIT_SIZE:
        return moments * numel * 4
    return moments * (numel + 4 * -(-numel // BLOCK))


def embedding_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights the HF Trainer registers for 32-bit state: every ``nn.Embedding``'s (a tied
    ``lm_head`` shares its embedding's parameter, so it is one of them), each once."""
    seen: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, nn.Embedding) and isinstance(m.weight, torch.Tensor):
            seen.setdefault(id(m.weight), m.weight)
    return list(seen.values())


class LayoutOptimizer(torch.optim.Optimizer):
    """AdamW (``moments=2``) or Lion (``moments=1``) with 32-bit or blockwise 8-bit state;
    ``keep32``: parameters whose state stays 32-bit (bitsandbytes' ``optim_bits=32`` override);
    ``embeddings32``: the model's ``nn.Embedding`` weights too, once :meth:`follow_model` is called."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        moments: int,
        bits: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        keep32: Iterable[torch.Tensor] = (),
        embeddings32: bool = False,
    ) -> None:
        if moments not in (1, 2) or bits not in (8, 32):
            raise ValueError("moments must be 1 (Lion) or 2 (AdamW), bits 8 or 32")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.moments, self.bits, self.embeddings32 = moments, bits, embeddings32
        self._keep32: set[int] = set()
        self.keep_in_32bit(keep32)
        self._maps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep_in_32bit(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep these parameters' state in 32 bits (by identity, as bitsandbytes matches ``id(p)``);
        a parameter whose state already exists keeps its layout, as in bitsandbytes."""
        self._keep32.update(id(t) for t in tensors)

    def follow_model(self, model: nn.Module, held: dict[int, torch.Tensor] | None = None) -> None:
        """With ``embeddings32``: the model's ``nn.Embedding`` weights keep 32-bit state. ``held``: the
        tensor this optimizer holds for a model parameter, by the parameter's id (fp32 master copies)."""
        if self.embeddings32:
            weights = embedding_weights(model)
            self.keep_in_32bit(weights if held is None else [held[id(w)] for w in weights if id(w) in held])

    def _qmaps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._maps:  # signed (first moment), unsigned (second): 256 floats each, held
            # for bitsandbytes' bytes; (de)quantization on this uniform grid is arithmetic (no index tensors)
            self._maps[device] = (torch.linspace(-1, 1, 256, device=device), torch.linspace(0, 1, 256, device=device))
        return self._maps[device]

    def _init(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.state[p]
        st["step"] = 0  # a Python int, as bitsandbytes keeps it
        eight = self.bits == 8 and p.numel() >= MIN_8BIT_SIZE and id(p) not in self._keep32
        blocks = -(-p.numel() // BLOCK)
        qmaps = self._qmaps(p.device) if eight else None
        for i in range(1, self.moments + 1):
            st[f"state{i}"] = torch.zeros_like(
                p, dtype=torch.uint8 if eight else torch.float32, memory_format=torch.contiguous_format
            )
            if qmaps is not None:
                st[f"qmap{i}"] = qmaps[i - 1]
                st[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return st

    @staticmethod
    def _blocks(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole blocks as a (blocks, 256) view and the partial last block (or None)."""
        whole = flat.numel() // BLOCK * BLOCK
        return flat[:whole].view(-1, BLOCK), (flat[whole:] if whole < flat.numel() else None)

    @classmethod
    def _dequant(cls, q: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
        """A float32 copy of the state (bitsandbytes' ``dequantize_blockwise``: that copy only).
        The uniform map is arithmetic, so no index tensor is made."""
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        out.copy_(q)
        out.mul_(2 / 255 if signed else 1 / 255)
        if signed:
            out.sub_(1)
        else:  # the unsigned grid holds fourth roots: small second moments stay nonzero (no eps-sized denominators)
            out.pow_(4)
        blocks, tail = cls._blocks(out.view(-1))
        blocks.mul_(absmax[: blocks.shape[0]].unsqueeze(-1))
        if tail is not None:
            tail.mul_(absmax[-1])
        return out

    @classmethod
    def _quant(cls, x: torch.Tensor, signed: bool, absmax: torch.Tensor, q: torch.Tensor) -> None:
        """The state back in 8 bits: a ``uint8`` copy and new absmax, then copied in (bitsandbytes'
        ``quantize_blockwise``, then ``_quant_blockwise_fp32_direct``); ``x`` is a scratch copy."""
        out = torch.empty(q.shape, dtype=torch.uint8, device=x.device)
        top = torch.empty(absmax.shape, dtype=torch.float32, device=x.device)
        blocks, tail = cls._blocks(x.view(-1))
        if blocks.numel():
            top[: blocks.shape[0]] = torch.maximum(blocks.amax(-1), blocks.amin(-1).neg())
        if tail is not None:
            top[-1] = torch.maximum(tail.amax(), tail.amin().neg())
        top.clamp_(min=1e-12)
        blocks.div_(top[: blocks.shape[0]].unsqueeze(-1))
        if tail is not None:
            tail.div_(top[-1])
        if signed:
            x.add_(1).mul_(127.5)
        else:
            x.pow_(0.25).mul_(255)
        out.copy_(x.round_().clamp_(0, 255))
        q.copy_(out)
        absmax.copy_(top)

    makes_state_on_zero_grads = True  # the engine's steady-state measurement needs no whole first step

    @torch.no_grad()
    def init_state_on_zero_grads(self) -> bool:
        """The state a first step makes (every parameter with a gradient), without its update."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state.get(p):
                    self._init(p)
        return True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p] if self.state.get(p) else self._init(p)
                st["step"] += 1
                eight = st["state1"].dtype == torch.uint8
                m = [
                    self._dequant(st[f"state{i}"], st[f"absmax{i}"], i == 1) if eight else st[f"state{i}"]
                    for i in range(1, self.moments + 1)
                ]
                g = p.grad.float() * 1.0 if eight else p.grad.float()  # bitsandbytes' 8-bit kernel scales a copy
                w = p.float()
                w.mul_(1 - lr * wd)
                if self.moments == 1:  # Lion: the sign of an interpolation, then the moment
                    w.add_(torch.sign(m[0].mul(b1) + g.mul(1 - b1)), alpha=-lr)
                    m[0].mul_(b2).add_(g, alpha=1 - b2)
                else:
                    step = st["step"]
                    m[0].mul_(b1).add_(g, alpha=1 - b1)
                    m[1].mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (m[1].sqrt() / (1 - b2**step) ** 0.5).add_(eps)
                    w.addcdiv_(m[0], denom, value=-lr / (1 - b1**step))
                p.copy_(w)
                if eight:
                    for i, x in enumerate(m, 1):
                        self._quant(x, i == 1, st[f"absmax{i}"], st[f"state{i}"])
        return None
