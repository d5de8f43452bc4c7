"""TRL's fused LM head as TRL 1.16 runs it: the loss kinds ``"trl_cpu"`` and ``"trl_cuda"``.

``SFTTrainer`` patches the model (``trl/trainer/utils.py``, ``add_fused_lm_head``) so that the
step runs the backbone and then ``_ChunkedLogProbFunction`` (``trl/kernels/chunked_logprob.py``)
with ``outputs=("log_probs", "entropy", "is_top1")`` (``sft_trainer.py``: entropy and
``mean_token_accuracy`` are logged every step). What that costs depends on the device:

- **CPU path** (no Triton: CPU, or a device Triton does not drive). Every position is scored
  (``hidden.reshape(-1, H)``: a copy, the slice ``[:, :-1]`` is not contiguous), the labels
  clamped. One ``min(N, 4096) x 32768`` buffer of the compute dtype holds each tile *whatever the
  vocabulary*, and the tile is folded by torch ops that each make a ``tokens x tile`` temporary;
  backward recomputes every tile and holds seven float32 ``tokens x tile`` temporaries and a bool
  one at once. This module runs the same ops in the same order, so a real CPU step allocates
  what TRL's does (checked against the allocator running the real ``SFTTrainer``).
- **CUDA path** (Triton). Only positions whose label is not -100 are scored (``hidden[mask]``,
  ``labels[mask]``, gathered copies); Triton kernels fold each tile in registers and overwrite it
  in place with its gradient, so the tile buffer and the per-token vectors are all the head
  holds; the outputs are scattered back (``new_zeros(...).masked_scatter``). Here the folds are
  done in place on the tile; the log-probabilities are exact, the logged entropy is not (it only
  feeds a metric; its buffer has the right size).

``trl_smooth`` adds what ``label_smoothing_factor > 0`` runs: the model's own forward (full
logits) through Hugging Face's label smoother, then a second, no-grad fused pass for the metrics.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memsave_nb.checkpointing import PlanError
from memsave_nb.vocabulary import LOSSES

__all__ = ["TOKEN_TILE", "TRL_LOSSES", "VOCAB_TILE", "TrlHeadOutput", "trl_head", "use_trl_head"]

TOKEN_TILE, VOCAB_TILE = 4096, 32768  # chunked_logprob.TOKEN_CHUNK_SIZE, utils._CHUNKED_LOGPROB_CHUNK_SIZE
TRL_LOSSES: dict[str, str] = {k: v for k, v in LOSSES.items() if k.startswith("trl_")}  # named in vocabulary
IGNORE_INDEX = -100


@dataclass
class TrlHeadOutput:
    """What the fused forward returns: the loss and the per-token outputs TRL's step reads."""

    loss: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    label_mask: torch.Tensor


def _fold_cpu(tile: torch.Tensor, targets: torch.Tensor, st: dict[str, torch.Tensor], start: int, width: int) -> None:
    """One tile into the running log-sum-exp, entropy and top-1 statistics, op by op as TRL's
    ``_forward_tile`` (logit scale 1, no soft-capping, temperature 1: two scalings still allocate)."""
    z = tile.float() * 1.0 * 1.0
    local = targets - start
    before = torch.arange(width, device=z.device) < local.unsqueeze(-1)
    st["max_before"].copy_(torch.maximum(st["max_before"], z.masked_fill(~before, -math.inf).amax(-1)))
    new_m = torch.maximum(st["max"], z.amax(-1))
    rescale = torch.exp(st["max"] - new_m)
    e = torch.exp(z - new_m.unsqueeze(-1))
    st["sum"].mul_(rescale).add_(e.sum(-1))
    st["xsum"].mul_(rescale).add_((e * z).sum(-1))
    st["max"].copy_(new_m)
    inside = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    st["target"].copy_(torch.where(inside, picked, st["target"]))


def _fold_cuda(tile: torch.Tensor, targets: torch.Tensor, st: dict[str, torch.Tensor], start: int, width: int) -> None:
    """The Triton fold's result for the log-probabilities, computed in place on the tile (Triton
    allocates nothing per tile; the per-token reductions here are ``tokens`` floats)."""
    local = targets - start
    inside = (local >= 0) & (local < width)
    picked = tile.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1).float()
    st["target"].copy_(torch.where(inside, picked, st["target"]))
    new_m = torch.maximum(st["max"], tile.amax(-1).float())
    st["sum"].mul_(torch.exp(st["max"] - new_m)).add_(
        tile.sub_(new_m.unsqueeze(-1).to(tile.dtype)).exp_().sum(-1).float()
    )
    st["max"].copy_(new_m)


def _grad_tile_cpu(tile: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, g: torch.Tensor, start: int) -> None:
    """The tile overwritten with d(log p_target)/d(logits), op by op as TRL's ``_backward_tile``."""
    y = tile.float() * 1.0
    z = y * 1.0
    log_p = z - log_z.unsqueeze(-1)  # TRL names it (the entropy gradient reads it): alive with p
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    hit = torch.arange(start, start + tile.shape[1], device=z.device) == targets.unsqueeze(-1)
    grad += g.unsqueeze(-1) * (hit.float() - p)
    grad = grad * 1.0
    tile.copy_(grad * 1.0)


def _grad_tile_cuda(
    tile: torch.Tensor, targets: torch.Tensor, log_z: torch.Tensor, g: torch.Tensor, start: int
) -> None:
    """The same gradient in place on the tile, as the Triton kernel writes it."""
    tile.sub_(log_z.unsqueeze(-1).to(tile.dtype)).exp_().mul_(-g.unsqueeze(-1).to(tile.dtype))
    local = targets - start
    inside = (local >= 0) & (local < tile.shape[1])
    picked = torch.where(inside, g, 0).to(tile.dtype).unsqueeze(-1)  # no data-dependent shapes (fake mode)
    tile.scatter_add_(1, local.clamp(0, tile.shape[1] - 1).unsqueeze(-1), picked)


class _TrlHead(torch.autograd.Function):
    """Per-token log-probabilities of ``hidden @ weight.T`` in ``tokens x 32768`` tiles, with
    entropy and top-1 for TRL's logged metrics; backward recomputes each tile."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        cuda: bool,
    ) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        n_tok, vocab, dev = hidden.shape[0], weight.shape[0], hidden.device
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else hidden.dtype
        st = {
            "max": torch.full((n_tok,), -math.inf, device=dev),
            "sum": torch.zeros(n_tok, device=dev),
            "xsum": torch.zeros(n_tok, device=dev),
            "sq": torch.zeros(n_tok, device=dev),
            "zsum": torch.zeros(n_tok, device=dev),
            "max_before": torch.full((n_tok,), -math.inf, device=dev),
            "target": torch.zeros(n_tok, device=dev),
        }  # TRL allocates all seven whatever it computes
        buf = torch.empty((min(n_tok, TOKEN_TILE), VOCAB_TILE), device=dev, dtype=dtype)
        fold = _fold_cuda if cuda else _fold_cpu
        for a in range(0, n_tok, TOKEN_TILE):
            b = min(a + TOKEN_TILE, n_tok)
            h = hidden[a:b].to(dtype)
            for s in range(0, vocab, VOCAB_TILE):
                e = min(s + VOCAB_TILE, vocab)
                tile = buf[: b - a, : e - s]
                torch.mm(h, weight[s:e].to(dtype).t(), out=tile)
                if bias is not None:
                    tile.add_(bias[s:e].to(dtype))
                fold(tile, targets[a:b], {k: v[a:b] for k, v in st.items()}, s, e - s)
        log_z = st["max"] + torch.log(st["sum"])
        log_probs = st["target"] - log_z
        entropy = log_z - st["xsum"] / st["sum"]
        top1 = (st["target"] >= st["max"]) & (st["target"] > st["max_before"])
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.dtype, ctx.cuda = dtype, cuda
        ctx.mark_non_differentiable(top1)
        return log_probs, entropy, top1

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        hidden, weight, bias, targets, log_z, _entropy = ctx.saved_tensors
        if g_ent is not None:
            raise PlanError("TRL's fused head: a gradient through the logged entropy is not sized")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n_tok, vocab, dtype = hidden.shape[0], weight.shape[0], ctx.dtype
        gh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
        gw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
        gb = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if need_b else None
        buf = torch.empty((min(n_tok, TOKEN_TILE), VOCAB_TILE), device=hidden.device, dtype=dtype)
        g_logp = g_logp.float().contiguous() if g_logp is not None else torch.zeros_like(log_z)
        grad_tile = _grad_tile_cuda if ctx.cuda else _grad_tile_cpu
        for a in range(0, n_tok, TOKEN_TILE):
            b = min(a + TOKEN_TILE, n_tok)
            h = hidden[a:b].to(dtype)
            for s in range(0, vocab, VOCAB_TILE):
                e = min(s + VOCAB_TILE, vocab)
                w = weight[s:e].to(dtype)
                tile = buf[: b - a, : e - s]
                torch.mm(h, w.t(), out=tile)
                if bias is not None:
                    tile.add_(bias[s:e].to(dtype))
                grad_tile(tile, targets[a:b], log_z[a:b], g_logp[a:b], s)
                if gh is not None:
                    gh[a:b].addmm_(tile.float(), w.float())
                if gw is not None:
                    gw[s:e].addmm_(tile.t().float(), h.float())
                if gb is not None:
                    gb[s:e] += tile.sum(dim=0, dtype=torch.float32)
        return (
            None if gh is None else gh.to(hidden.dtype),
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
        )


def trl_head(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: nn.Linear,
    *,
    cuda: bool,
    valid_count: int | None = None,
    num_items: Any = None,
) -> TrlHeadOutput:
    """TRL's fused head on ``hidden`` (B, T, H) and ``labels`` (B, T) (already shifted).
    ``valid_count``: positions kept on the CUDA path when the labels are fake (values unknown)."""
    from torch._subclasses.fake_tensor import is_fake

    mask = labels != IGNORE_INDEX
    flat = hidden.reshape(-1, hidden.size(-1))
    if not cuda:
        per_token = _TrlHead.apply(flat, head.weight, head.bias, labels.clamp(min=0).reshape(-1), False)
        per_token = [x.view(mask.shape).masked_fill(~mask, 0) for x in per_token]
    else:
        if is_fake(labels):  # a gather of the kept rows: as many as the real batch keeps (else all)
            keep = labels.numel() if valid_count is None else valid_count
            at = torch.arange(keep, device=labels.device)
            rows, cols = at // labels.shape[-1], at % labels.shape[-1]  # one gather, as hidden[mask] makes
            picked, targets = hidden[rows, cols], labels[rows, cols]
        else:
            picked, targets = hidden[mask], labels[mask]
        per_token = _TrlHead.apply(picked, head.weight, head.bias, targets, True)
        per_token = [x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token]
    log_probs, entropy, top1 = per_token
    loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
    return TrlHeadOutput(loss, log_probs, entropy, top1, mask)


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    get_base: Any = getattr(model, "get_base_model", None)
    lm = get_base() if callable(get_base) else model
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None or getattr(lm, "base_model", lm) is lm:
        raise PlanError(
            f"TRL's fused head needs a Hugging Face *ForCausalLM (a backbone and an LM head); "
            f"{type(lm).__name__} is not one"
        )
    if type(head) is not nn.Linear:
        raise PlanError(f"TRL's fused head reads the LM head's weight: {type(head).__name__} is not a plain nn.Linear")
    return lm, head


def use_trl_head(
    model: nn.Module, *, cuda: bool, smoothing: float = 0.0, valid_hint: tuple[tuple[int, ...], int] | None = None
) -> Callable[[], None]:
    """Make ``model(**batch)`` (with ``labels``) run TRL's SFT loss as ``SFTTrainer.compute_loss``
    does, the metrics' reductions included; returns the undo."""
    from torch._subclasses.fake_tensor import is_fake

    lm, _ = _parts(model)
    if "forward" in lm.__dict__:
        raise PlanError(f"TRL's fused head replaces {type(lm).__name__}.forward, which is already replaced")
    own_forward = type(lm).forward

    def fused(self: nn.Module, args: tuple, kwargs: dict[str, Any], labels: torch.Tensor) -> TrlHeadOutput:
        _, head = _parts(self)
        backbone: Any = self.base_model
        hidden = backbone(*args, **{**kwargs, "use_cache": False}).last_hidden_state[:, :-1]
        shifted = labels[:, 1:]
        count = valid_hint[1] if valid_hint is not None and valid_hint[0] == tuple(shifted.shape) else None
        return trl_head(hidden, shifted.to(head.weight.device), head, cuda=cuda, valid_count=count)

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> TrlHeadOutput:
        if labels is None:
            raise PlanError("TRL's fused head needs labels in the batch (the loss is computed in the forward)")
        if smoothing > 0:
            loss = _smoothed_loss(own_forward(self, *args, **{**kwargs, "use_cache": False}).logits, labels, smoothing)
            with torch.no_grad():
                out = fused(self, args, kwargs, labels)
            out.loss = loss
        else:
            out = fused(self, args, kwargs, labels)
            out.loss = (-out.log_probs).sum() / out.label_mask.sum().clamp(min=1)  # compute_loss's own
        _metrics(out, fake=is_fake(labels))
        return out

    lm.forward = types.MethodType(forward, lm)

    def undo() -> None:
        lm.__dict__.pop("forward", None)

    return undo


def _metrics(out: TrlHeadOutput, fake: bool) -> None:
    """The reductions ``compute_loss`` logs (entropy and token accuracy): small, but allocated."""
    valid = out.label_mask.sum()
    ent = out.entropy.detach().sum()
    correct = out.is_top1.sum()
    if not fake:
        (ent / valid).item(), (correct / valid).item()


def _smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``LabelSmoother`` with ``shift_labels=True`` (``trainer_pt_utils.py``)."""
    logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    log_probs = -nn.functional.log_softmax(logits, dim=-1)
    labels = labels.unsqueeze(-1)
    pad = labels.eq(IGNORE_INDEX)
    labels = torch.clamp(labels, min=0)
    nll = log_probs.gather(dim=-1, index=labels)
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
    nll.masked_fill_(pad, 0.0)
    smoothed.masked_fill_(pad, 0.0)
    active = pad.numel() - pad.long().sum()
    nll = nll.sum() / active
    smoothed = smoothed.sum() / (active * log_probs.shape[-1])
    return (1 - eps) * nll + eps * smoothed
