"""Cross-entropy through a linear head, in chunks of tokens: the ``(tokens, vocab)`` logits are
never built whole, in forward or backward.

A causal LM's loss is ``cross_entropy(hidden @ W.T, labels)``. Built whole, the logits of a
150k-vocabulary model are often the largest tensor of a step, and the full loss keeps more than
one of them (the logits, the log-softmax it saves, and in backward its gradient). Here forward
projects ``chunk`` tokens at a time, keeps only each token's log-sum-exp, and backward projects
each chunk again to form ``softmax - onehot`` and the two gradients (hidden states and head
weight, the latter accumulated). At any time one ``(chunk, vocab)`` buffer is alive (two while a
low-precision chunk is widened to float32, as Hugging Face's loss widens its logits).

Some models change the logits between the head and the loss (Gemma 2's soft-capping
``cap * tanh(z / cap)``, Cohere's and Granite's scaling): ``logit_scale`` and ``softcap`` apply that
to each chunk, in forward and backward (with ``softcap`` two ``(chunk, vocab)`` buffers are alive in
backward: the ``tanh`` is kept for its derivative).

Liger's fused linear cross-entropy, torchtune's ``LinearCrossEntropyLoss`` and TRL's fused LM head
do the same; this one is plain torch ops (CPU, CUDA, fake tensors). Positions labelled
``ignore_index`` are dropped before the head (as TRL does on GPUs), so they cost nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunked_linear_cross_entropy", "valid_positions"]


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    """The matmul's dtype: autocast's when it is on for this device, else the hidden states'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _wide(t: Tensor) -> Tensor:
    """Logits in at least float32 (Hugging Face's loss does ``logits.float()``)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _chunk_logits(
    h: Tensor, weight: Tensor, bias: Tensor | None, logit_scale: float = 1.0, softcap: float | None = None
) -> Tensor:
    """The chunk's logits as the model's loss sees them; with ``softcap`` the buffer holds
    ``tanh(z / cap)`` (the caller multiplies by ``cap``, or keeps it for the derivative)."""
    out = _wide(h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t()))
    if logit_scale != 1.0:
        out.mul_(logit_scale)
    if softcap is not None:
        out.div_(softcap).tanh_()
    return out


class _ChunkedLinearCE(torch.autograd.Function):
    """``sum_i (logsumexp(z_i) - z_i[t_i]) * scale`` with ``z = f(h @ W.T + b)``, chunk by chunk
    (``f``: times ``logit_scale``, then ``cap * tanh(. / cap)`` when ``softcap``)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,  # type: ignore[override]
        chunk: int,
        scale: float,
        logit_scale: float = 1.0,
        softcap: float | None = None,
    ) -> Tensor:
        cdt = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            n = hidden.shape[0]
            lse = torch.empty(n, dtype=torch.promote_types(cdt, torch.float32), device=hidden.device)
            total = torch.zeros((), dtype=lse.dtype, device=hidden.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _chunk_logits(hidden[s:e].to(cdt), w, b, logit_scale, softcap)  # (c, V), the one chunk buffer
                if softcap is not None:
                    z.mul_(softcap)
                picked = z.gather(1, targets[s:e, None]).squeeze(1)
                top = z.amax(1)
                z.sub_(top[:, None]).exp_()  # in place: no second (c, V) buffer
                lse[s:e] = z.sum(1).log_().add_(top)
                total += (lse[s:e] - picked).sum()
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk, ctx.scale, ctx.cdt = chunk, scale, cdt
        ctx.logit_scale, ctx.softcap = logit_scale, softcap
        return total * scale  # float32 (float64 for float64 inputs), as Hugging Face's loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        cdt, chunk, logit_scale, softcap = ctx.cdt, ctx.chunk, ctx.logit_scale, ctx.softcap
        g = grad_out.to(lse.dtype) * ctx.scale
        n = hidden.shape[0]
        acc = lse.dtype if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if (need_b and bias is not None) else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(cdt)
            b = None if bias is None else bias.to(cdt)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e].to(cdt)
                z = _chunk_logits(h, w, b, logit_scale, softcap)
                t = None
                if softcap is not None:  # z holds tanh(z / cap): keep it for 1 - tanh^2
                    t, z = z, torch.mul(z, softcap)
                z.sub_(lse[s:e, None]).exp_()  # softmax
                z.scatter_add_(1, targets[s:e, None], torch.full((e - s, 1), -1.0, dtype=z.dtype, device=z.device))
                z.mul_(g)  # d loss / d (transformed) logits for this chunk
                if t is not None:
                    z.mul_(t.square_().neg_().add_(1.0))  # d cap*tanh(x/cap) / dx
                    del t
                if logit_scale != 1.0:
                    z.mul_(logit_scale)  # d loss / d head output
                if grad_h is not None:
                    grad_h[s:e] = (z.to(cdt) @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w.addmm_(z.t().to(acc), h.to(acc))
                if grad_b is not None:
                    grad_b += z.sum(0).to(acc)
                del z
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def valid_positions(labels: Tensor, ignore_index: int = -100, count: int | None = None) -> tuple[Tensor | None, int]:
    """Flat indices of the positions whose label is not ``ignore_index``, in order (``None`` when
    all are kept), and how many are kept.

    ``count`` (when known, e.g. from the real batch under fake tensors) avoids reading the labels'
    values: the indices come from a stable sort, whose shape does not depend on values."""
    flat = labels.reshape(-1)
    keep = flat != ignore_index
    if count is None:
        count = int(keep.sum())
    if count == flat.shape[0]:
        return None, count
    order = torch.argsort((~keep).to(torch.uint8), stable=True)
    return order[:count], count


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    chunk: int = 1024,
    ignore_index: int = -100,
    reduction: str = "mean",
    valid_count: int | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels, ignore_index=..., reduction=...)`` over the
    flattened leading dimensions, without building the ``(tokens, vocab)`` logits: ``chunk`` tokens at
    a time in forward and backward. ``reduction``: ``"mean"`` (over the kept positions; 0 when none)
    or ``"sum"``. Positions labelled ``ignore_index`` are dropped before the head. ``valid_count``:
    the number of kept positions when the caller knows it (fake tensors cannot be counted).
    ``logit_scale`` / ``softcap``: the logits are ``cap * tanh(logit_scale * z / cap)`` (Gemma 2's
    soft-capping, Cohere's and Granite's scaling) before the cross-entropy."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    if flat.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden positions but {flat.shape[0]} labels")
    index, count = valid_positions(flat, ignore_index, valid_count)
    if index is not None:
        h, flat = h.index_select(0, index), flat.index_select(0, index)
    for name, v in (("logit_scale", logit_scale), ("softcap", softcap)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
    return _ChunkedLinearCE.apply(
        h, weight, bias, flat, chunk, scale, float(logit_scale), None if softcap is None else float(softcap)
    )
