"""The loss knob: the model's own full loss, or cross-entropy through the LM head in chunks of
tokens (TRL's ``SFTTrainer`` default, Liger's fused linear cross-entropy, torchtune's
``LinearCrossEntropyLoss``).

``Plan(loss="chunked", loss_chunk=1024)`` makes the measured step run
:func:`memsave_nb.layers.linear_ce.chunked_linear_cross_entropy`: the causal LM's forward is
replaced, for the step, by its backbone (``model.base_model``: hidden states) and the chunked loss
on the head's weight with the labels shifted by one, as TRL's fused LM head does
(``trl/trainer/utils.py``, ``add_fused_lm_head``). The ``batch x seq x vocab`` logits are never
built; positions labelled -100 are dropped before the head. The forward returns an object with
``.loss`` only (no logits), so the workload's default loss reads it. The zoo's GPT
(``hidden_states(idx)``, ``head``, aligned ``targets``) takes it too. ``loss="full"`` is the
model's own loss, as given (nothing changes). Nothing here measures or imports ``transformers``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.vocabulary import LOSSES

__all__ = ["LOSSES", "DEFAULT_LOSS_CHUNK", "IGNORE_INDEX", "check_loss", "use_chunked_loss", "causal_lm",
           "ChunkedLossOutput", "apply_loss"]

DEFAULT_LOSS_CHUNK = 1024  # tokens per chunk
IGNORE_INDEX = -100


def check_loss(loss: Any, chunk: Any) -> tuple[str | None, int | None]:
    """The normalised ``(loss, loss_chunk)`` of a plan, or one ``PlanError`` line."""
    if loss is not None:
        if not isinstance(loss, str) or loss.lower() not in LOSSES:
            raise PlanError(f"loss {show(loss)}: choose one of {sorted(LOSSES)} or None")
        loss = loss.lower()
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 2**31 - 1:
            raise PlanError(f"loss_chunk must be a positive integer (tokens per chunk) or None, got {show(chunk)}")
        if loss != "chunked":
            raise PlanError(f"loss_chunk {chunk} needs loss='chunked'")
    return loss, chunk


@dataclass
class ChunkedLossOutput:
    """What the chunked forward returns: the loss only (the logits were never built)."""

    loss: torch.Tensor


def causal_lm(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """``(causal LM, head)``: a Hugging Face causal LM (a peft model's base model too: backbone
    ``base_model``, head ``get_output_embeddings()``) or a model with a ``hidden_states(idx)``
    method and a ``head`` (the zoo's GPT); else one ``PlanError`` line saying why the chunked loss
    does not apply."""
    lm = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None and callable(getattr(lm, "hidden_states", None)):
        head = getattr(lm, "head", None)
    elif getattr(lm, "base_model", lm) is lm:
        head = None
    if head is None:
        raise PlanError(f"loss='chunked' needs a causal LM with a backbone and an LM head (Hugging Face's "
                        f"*ForCausalLM, or hidden_states() and head); {type(lm).__name__} has none")
    if type(head) is not nn.Linear:
        raise PlanError(f"loss='chunked' reads the LM head's weight: {type(head).__name__} (an adapter or quantized "
                        "head) is not a plain nn.Linear")
    return lm, head


def _hidden_and_targets(lm: nn.Module, args: tuple, kwargs: dict[str, Any],
                        labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states before the head and the target of each: Hugging Face's labels are the
    inputs (position t predicts label t+1); the zoo's ``targets`` are already aligned."""
    if callable(getattr(lm, "get_output_embeddings", None)):
        if labels is None:
            raise PlanError("loss='chunked' needs labels in the batch (the loss is computed in the forward)")
        kwargs.setdefault("use_cache", False)  # as TRL's fused head: no KV cache in a training step
        hidden = lm.base_model(*args, **kwargs).last_hidden_state
        return hidden[:, :-1], labels[:, 1:]  # (B, T-1, H): position t predicts t+1
    targets = kwargs.pop("targets", None)
    if targets is None and len(args) > 1:
        args, targets = args[:1], args[1]
    if targets is None:
        raise PlanError("loss='chunked' needs targets in the batch (the loss is computed in the forward)")
    return lm.hidden_states(*args, **kwargs), targets


def _valid_hint(batch: Any) -> tuple[tuple[int, ...], int] | None:
    """(targets' shape, count kept) of a real batch's ``labels`` (shifted by one) or ``targets``
    (aligned): fake tensors cannot be counted."""
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get("labels")
    targets = labels[:, 1:] if isinstance(labels, torch.Tensor) and labels.dim() >= 2 else batch.get("targets")
    if not isinstance(targets, torch.Tensor) or targets.dim() < 2 or _is_fake(targets) or targets.device.type == "meta":
        return None
    return tuple(targets.shape), int((targets != IGNORE_INDEX).sum())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def use_chunked_loss(model: nn.Module, chunk: int = DEFAULT_LOSS_CHUNK, *,
                     valid_hint: tuple[tuple[int, ...], int] | None = None) -> Callable[[], None]:
    """Make ``model(**batch)`` (with ``labels``, or the zoo GPT's ``targets``) return ``ChunkedLossOutput(loss)``, the loss computed
    by the chunked linear cross-entropy; returns the undo. In a training script call it once and keep
    it (``training_step``'s ``output.loss`` reads it). ``valid_hint``: ``(labels shape, kept count)``
    for fake-tensor steps of a known batch (without it a fake step keeps every position)."""
    from memsave_nb.layers.linear_ce import chunked_linear_cross_entropy

    lm, _ = causal_lm(model)
    if "forward" in lm.__dict__:
        raise PlanError(f"loss='chunked' replaces {type(lm).__name__}.forward, which is already replaced "
                        "(a checkpointed region on the model itself?)")

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> ChunkedLossOutput:
        _, head = causal_lm(self)
        hidden, targets = _hidden_and_targets(self, args, kwargs, labels)
        count = None
        if _is_fake(targets):  # values unknown: the real batch's count, else every position kept
            count = valid_hint[1] if valid_hint is not None and valid_hint[0] == tuple(targets.shape) else targets.numel()
        loss = chunked_linear_cross_entropy(hidden, head.weight, targets.to(hidden.device), bias=head.bias,
                                            chunk=chunk, ignore_index=IGNORE_INDEX, valid_count=count)
        return ChunkedLossOutput(loss)

    lm.forward = types.MethodType(forward, lm)

    def undo() -> None:
        lm.__dict__.pop("forward", None)

    return undo


def apply_loss(loss: str | None, chunk: int | None, workload: Any, batch: Any) -> list[Callable[[], None]]:
    """The undo callbacks of the loss knob on ``workload.model`` (``batch``: the step's batch, after
    the other knobs). ``Plan.apply`` calls it through ``knobs.apply_knobs``."""
    if loss != "chunked":
        return []
    if workload.loss is not None:
        raise PlanError("loss='chunked' computes the loss in the model's forward from the batch's labels: "
                        "the workload's own loss function would not see logits (leave Workload.loss unset)")
    return [use_chunked_loss(workload.model, chunk or DEFAULT_LOSS_CHUNK, valid_hint=_valid_hint(batch))]
