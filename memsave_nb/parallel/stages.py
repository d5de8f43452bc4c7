"""Splitting a model into pipeline stages, and what each stage's schedule is handed.

An ``nn.Sequential`` splits into contiguous runs of its children. A GPT-shaped decoder (the
zoo's: ``wte``, ``wpe``, ``blocks``, ``ln_f``, ``head``, found by attribute, never by class)
splits its blocks evenly: the first stage also embeds, the last also normalises and projects
to the vocabulary, as torchtitan splits its decoders. A Hugging Face decoder (``model.embed_tokens``,
``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``: Llama, Mistral, Qwen2 and
their kin) splits its layers the same way, each stage computing the rotary position embeddings
again (they hold no parameters) and running causal attention without a mask, as the whole model
does without padding. Any other model takes a ``stages=fn(model, n)`` of the user's. Nothing here
knows a schedule.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel_spec import ParallelError

_GPT_PARTS = ("wte", "wpe", "blocks", "ln_f", "head")


def _even(count: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous (start, end) ranges over ``count`` items, the first ones one longer."""
    if count < n:
        raise ParallelError(f"pipeline stages: {count} layers cannot make {n} stages")
    q, r = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append((start, end))
        start = end
    return out


def is_gpt_shaped(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in _GPT_PARTS) and isinstance(model.blocks, nn.ModuleList)


class GPTStage(nn.Module):
    """A run of a GPT-shaped decoder's blocks; the first stage embeds token ids, the last returns logits."""

    def __init__(self, model: Any, start: int, end: int):  # GPT-shaped: wte, wpe, blocks, ln_f, head
        super().__init__()
        self.first, self.last = start == 0, end == len(model.blocks)
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, getattr(model, "drop", nn.Identity())
        self.blocks = nn.ModuleList(model.blocks[start:end])
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: token ids (B, T)
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x  # (B, T, vocab) or (B, T, C)


_HF_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def is_hf_decoder(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return (
        isinstance(inner, nn.Module)
        and all(hasattr(inner, a) for a in _HF_PARTS)
        and isinstance(inner.layers, nn.ModuleList)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


class HFDecoderStage(nn.Module):
    """A run of a Hugging Face decoder's layers; the first stage embeds token ids, the last returns logits."""

    def __init__(self, model: Any, start: int, end: int):  # is_hf_decoder: model.layers, lm_head...
        super().__init__()
        inner = model.model
        self.first, self.last = start == 0, end == len(inner.layers)
        if self.first:
            self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleList(inner.layers[start:end])
        if self.last:
            self.norm, self.lm_head = inner.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: token ids (B, T)
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = self.rotary_emb(x, position_ids=positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
            x = x[0] if isinstance(x, tuple) else x
        return self.lm_head(self.norm(x)) if self.last else x  # (B, T, vocab) or (B, T, hidden)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The model inside a peft ``PeftModel`` (its LoRA layers in place: the stages share them)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and type(model).__name__.startswith("Peft") else model


def split_stages(model: nn.Module, n: int) -> list[nn.Module]:
    """``n`` stages of an ``nn.Sequential`` (its children, evenly) or of a GPT-shaped decoder (its
    blocks, evenly), also inside a peft model. The stages share the model's modules. Other models:
    pass ``stages=``."""
    model = unwrap_peft(model)
    if isinstance(model, nn.Sequential):
        children = list(model)
        return [nn.Sequential(*children[a:b]) for a, b in _even(len(children), n)]
    # (the casts: torch's stub types a submodule attribute as Tensor | Module; the checks saw lists)
    if is_gpt_shaped(model):
        return [GPTStage(model, a, b) for a, b in _even(len(cast(nn.ModuleList, model.blocks)), n)]
    if is_hf_decoder(model):
        return [
            HFDecoderStage(model, a, b)
            for a, b in _even(len(cast(nn.ModuleList, cast(nn.Module, model.model).layers)), n)
        ]
    raise ParallelError(
        f"pipeline stages: {type(model).__name__} is neither an nn.Sequential, GPT-shaped nor a "
        f"Hugging Face decoder; "
        f"pass stages=fn(model, n) -> n stage modules"
    )


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The zoo GPT's own loss, per micro-batch: cross-entropy over the vocabulary."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's loss, per micro-batch, as its ``ForCausalLMLoss``: the logits in
    float32, the labels shifted left by one (padded with the ignore index)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=-100)


def stage_inputs(
    model: nn.Module, batch: Any, loss_fn: Callable | None, target: Any, workload_loss: Callable[[Any], torch.Tensor]
) -> tuple[tuple, Any, Callable]:
    """(positional inputs of the first stage, target, loss_fn(output, target_chunk)) for a batch.

    A tensor or tuple batch goes in as it is; the zoo GPT's ``{"idx", "targets"}`` gives the token
    ids to the first stage and the targets to its own loss. Without ``loss_fn`` the workload's own
    loss runs on each micro-batch's output.
    """
    model = unwrap_peft(model)
    if isinstance(batch, dict) and is_gpt_shaped(model) and {"idx", "targets"} <= set(batch):
        return (batch["idx"],), batch["targets"] if target is None else target, loss_fn or _token_loss
    if (
        isinstance(batch, dict)
        and is_hf_decoder(model)
        and set(batch) <= {"input_ids", "labels"}
        and "input_ids" in batch
    ):
        labels = batch.get("labels", batch["input_ids"]) if target is None else target
        return (batch["input_ids"],), labels, loss_fn or _causal_lm_loss
    if isinstance(batch, torch.Tensor):
        args: Sequence = (batch,)
    elif isinstance(batch, (tuple, list)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        args = tuple(batch)
    else:
        raise ParallelError(
            "pipeline stages take a tensor or a tuple of tensors as the batch (split into micro-batches "
            "on dim 0), or the zoo GPT's {'idx', 'targets'}"
        )
    return tuple(args), target, loss_fn or (lambda output, _target: workload_loss(output))
