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

A chunked loss that differs from the model's own would train a different model, so it runs only
on an allow-list of families whose forward was read: what each does between the last hidden state
and the loss (Gemma 2's soft-capping, Cohere's and Granite's logit scaling, Mixtral's router loss)
is a :class:`HeadTransform` run per chunk; anything else (masked LMs, encoder-decoders, unknown
causal LMs) is refused in one line before the step runs.

``loss="hf_smooth"`` is what Hugging Face's ``Trainer`` runs when ``label_smoothing_factor > 0``
(``trainer.py`` ``compute_loss`` and ``trainer_pt_utils.py`` ``LabelSmoother``, transformers 5.25):
the labels are taken out of the batch, the model runs without them (full logits, no loss of its
own), and the smoother holds the negated log-softmax of the logits (two ``batch x seq x vocab``
tensors beside them) while it gathers and sums. :func:`use_label_smoother` runs those ops in that
order; the factor does not change a byte, so the plan holds no factor.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from memsave_nb.checkpointing import PlanError, show
from memsave_nb.loss_trl import TRL_LOSSES, use_trl_head
from memsave_nb.vocabulary import LOSSES

__all__ = [
    "LOSSES",
    "DEFAULT_LOSS_CHUNK",
    "IGNORE_INDEX",
    "check_loss",
    "use_chunked_loss",
    "causal_lm",
    "ChunkedLossOutput",
    "HeadTransform",
    "FAMILIES",
    "apply_loss",
    "use_label_smoother",
    "label_smoother",
]

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
    """What the chunked forward returns: the loss only (the logits were never built); an MoE
    model's router loss (already in ``loss``) as ``aux_loss``."""

    loss: torch.Tensor
    aux_loss: torch.Tensor | None = None


@dataclass(frozen=True)
class HeadTransform:
    """What a causal LM's forward does between its LM head and its loss, run per chunk: logits
    times ``logit_scale``, then ``softcap * tanh(logits / softcap)``; ``router_aux``: the loss gets
    ``router_aux_loss_coef * load_balancing_loss_func(router logits)`` when the model asks for them."""

    logit_scale: float = 1.0
    softcap: float | None = None
    router_aux: bool = False


def _base_model(model: nn.Module) -> Any:
    """A peft model's base model, else ``model``: a Hugging Face or zoo model whose own methods
    (``get_output_embeddings``...) torch's ``Module.__getattr__`` stub types as Tensor | Module."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _hf_config(lm: nn.Module) -> Any:
    """``lm.config``: a Hugging Face config in the instance dict, not the stub's Tensor | Module."""
    return lm.config


def _number(lm: nn.Module, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise PlanError(f"loss='chunked': {type(lm).__name__}'s {name} is {show(value, 30)}, not a positive number")
    return float(value)


def _softcapped(lm: nn.Module) -> HeadTransform:  # Gemma 2/3: logits / cap -> tanh -> * cap
    cap = getattr(lm.config, "final_logit_softcapping", None)
    return HeadTransform(softcap=None if cap is None else _number(lm, "final_logit_softcapping", cap))


# Causal LMs whose forward (transformers 5.25) was read, head to loss, and whose chunked loss and
# gradients tests/measure/test_chunked_loss_families.py hold to the model's own in float64. An
# allow-list: any other model (masked LMs, encoder-decoders, unknown heads) is refused.
_PLAIN = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "GemmaForCausalLM",
    "GPT2LMHeadModel",
)
FAMILIES: dict[str, Callable[[nn.Module], HeadTransform]] = {
    **{name: (lambda lm: HeadTransform()) for name in _PLAIN},
    "Gemma2ForCausalLM": _softcapped,
    "Gemma3ForCausalLM": _softcapped,
    "CohereForCausalLM": lambda lm: HeadTransform(logit_scale=_number(lm, "logit_scale", lm.logit_scale)),
    "GraniteForCausalLM": lambda lm: HeadTransform(
        logit_scale=1.0 / _number(lm, "logits_scaling", _hf_config(lm).logits_scaling)
    ),
    "MixtralForCausalLM": lambda lm: HeadTransform(router_aux=True),
}
_ZOO_GPT = ("memsave_nb.zoo", "GPT")  # hidden_states(idx), head, aligned targets, plain cross-entropy


def _model_class(lm: nn.Module) -> type:
    """``lm``'s own class under torch.distributed's class swaps (``fully_shard``'s ``FSDP<Name>``,
    ``replicate``'s ``DDP<Name>``): they add hooks, not a forward."""
    cls = type(lm)
    while cls.__module__.startswith("torch.distributed.") and "forward" not in cls.__dict__:
        bases = [b for b in cls.__bases__ if not b.__module__.startswith("torch.distributed.")]
        if len(bases) != 1 or not cls.__name__.endswith(bases[0].__name__):
            break
        cls = bases[0]
    return cls


def _refusal(lm: nn.Module) -> str:
    """Why the chunked loss does not run ``lm`` (one line)."""
    name = _model_class(lm).__name__[:60]
    config = getattr(lm, "config", None)
    known = next((c.__name__ for c in _model_class(lm).__mro__[1:] if c.__name__ in FAMILIES), None)
    if known is not None:
        why = f"a subclass of {known[:40]} (its forward may differ)"
    elif getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder (its loss is on the decoder's outputs)"
    elif name.endswith(("ForMaskedLM", "ForPreTraining")):
        why = "a masked LM (its loss is on masked tokens, not the next token)"
    elif name.endswith(("ForCausalLM", "LMHeadModel")):
        why = "a causal LM whose forward between head and loss memsave_nb has not checked"
    else:
        why = "not a causal LM that memsave_nb knows"
    return f"loss='chunked' needs a causal LM: {name} is {why}; use loss='full'"


def causal_lm(model: nn.Module) -> tuple[nn.Module, nn.Linear, HeadTransform]:
    """``(causal LM, head, head transform)``: a Hugging Face causal LM of a checked family (a peft
    model's base model too: backbone ``base_model``, head ``get_output_embeddings()``) or the zoo's
    GPT (``hidden_states(idx)``, ``head``); else one ``PlanError`` line saying why the chunked loss
    does not apply. The class must be the library's own: a subclass may change the forward."""
    lm = _base_model(model)
    cls = _model_class(lm)
    if (cls.__module__, cls.__name__) == _ZOO_GPT:
        head, transform = getattr(lm, "head", None), HeadTransform()
    elif cls.__module__.startswith("transformers.models.") and cls.__name__ in FAMILIES:
        head, transform = lm.get_output_embeddings(), FAMILIES[cls.__name__](lm)
    else:
        raise PlanError(_refusal(lm))
    if type(head) is not nn.Linear:
        raise PlanError(
            f"loss='chunked' reads the LM head's weight: {type(head).__name__} (an adapter or quantized "
            "head) is not a plain nn.Linear"
        )
    return lm, head, transform


def _router_loss(lm: nn.Module, out: Any, attention_mask: Any) -> torch.Tensor:
    """The MoE router's load-balancing term, by the model's own module's function, as its forward."""
    import sys

    balance = sys.modules[_model_class(lm).__module__].load_balancing_loss_func
    return balance(out.router_logits, lm.num_experts, lm.num_experts_per_tok, attention_mask)


def _hf_hidden_and_targets(
    lm: Any,  # a Hugging Face causal LM: its base_model, config
    transform: HeadTransform,
    args: tuple,
    kwargs: dict[str, Any],
    labels: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A Hugging Face causal LM's hidden states before the head, the target of each (position t
    predicts label t+1, or ``shift_labels`` as given) and the router loss (or None)."""
    if labels is None:  # as the model: no labels, no loss (shift_labels alone included)
        raise PlanError("loss='chunked' needs labels in the batch (the loss is computed in the forward)")
    if kwargs.pop("logits_to_keep", 0) not in (0, None):
        raise PlanError("loss='chunked' computes the loss over every position: leave logits_to_keep unset")
    shift = kwargs.pop("shift_labels", None)
    kwargs.setdefault("use_cache", False)  # as TRL's fused head: no KV cache in a training step
    router = False
    if transform.router_aux:
        router = kwargs.pop("output_router_logits", None)
        router = _hf_config(lm).output_router_logits if router is None else router
        kwargs["output_router_logits"] = router
    out = lm.base_model(*args, **kwargs)
    hidden = out.last_hidden_state
    aux = _router_loss(lm, out, kwargs.get("attention_mask", args[1] if len(args) > 1 else None)) if router else None
    if shift is not None:
        return hidden, shift, aux
    return hidden[:, :-1], labels[:, 1:], aux  # (B, T-1, H): position t predicts t+1


def _gpt_hidden_and_targets(lm: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The zoo GPT's hidden states before the head and its ``targets`` (already aligned)."""
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


def use_chunked_loss(
    model: nn.Module, chunk: int = DEFAULT_LOSS_CHUNK, *, valid_hint: tuple[tuple[int, ...], int] | None = None
) -> Callable[[], None]:
    """Make ``model(**batch)`` (with ``labels``, or the zoo GPT's ``targets``) return ``ChunkedLossOutput(loss)``, the loss computed
    by the chunked linear cross-entropy; returns the undo. In a training script call it once and keep
    it (``training_step``'s ``output.loss`` reads it). ``valid_hint``: ``(labels shape, kept count)``
    for fake-tensor steps of a known batch (without it a fake step keeps every position)."""
    from memsave_nb.layers.linear_ce import chunked_linear_cross_entropy

    lm, _, transform = causal_lm(model)
    if "forward" in lm.__dict__:
        raise PlanError(
            f"loss='chunked' replaces {type(lm).__name__}.forward, which is already replaced "
            "(a checkpointed region on the model itself?)"
        )
    hf = (_model_class(lm).__module__, _model_class(lm).__name__) != _ZOO_GPT

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> ChunkedLossOutput:
        _, head, _ = causal_lm(self)
        items = kwargs.pop("num_items_in_batch", None) if hf else None  # Hugging Face: sum / items
        ignore = kwargs.pop("ignore_index", IGNORE_INDEX) if hf else IGNORE_INDEX
        if hf:
            hidden, targets, aux = _hf_hidden_and_targets(self, transform, args, kwargs, labels)
        else:
            (hidden, targets), aux = _gpt_hidden_and_targets(self, args, kwargs), None
        count = None
        if _is_fake(targets):  # values unknown: the real batch's count, else every position kept
            count = (
                valid_hint[1] if valid_hint is not None and valid_hint[0] == tuple(targets.shape) else targets.numel()
            )
        loss = chunked_linear_cross_entropy(
            hidden,
            head.weight,
            targets.to(hidden.device),
            bias=head.bias,
            chunk=chunk,
            ignore_index=ignore,
            valid_count=count,
            reduction="mean" if items is None else "sum",
            logit_scale=transform.logit_scale,
            softcap=transform.softcap,
        )
        if items is not None:
            loss = loss / (items.to(loss.device) if torch.is_tensor(items) else items)
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        return ChunkedLossOutput(loss, aux)

    lm.forward = types.MethodType(forward, lm)

    def undo() -> None:
        lm.__dict__.pop("forward", None)

    return undo


def label_smoother(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float = 0.1, *, shift: bool = True, num_items: Any = None
) -> torch.Tensor:
    """Hugging Face's ``LabelSmoother.__call__`` (transformers 5.25), op by op so that it allocates
    what it allocates: ``shift`` for causal LMs (the Trainer's ``shift_labels=True``), ``num_items``
    the Trainer's ``num_items_in_batch`` (else the batch's own count of kept labels)."""
    if shift:
        logits, labels = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    log_probs = -nn.functional.log_softmax(logits, dim=-1)
    if labels.dim() == log_probs.dim() - 1:
        labels = labels.unsqueeze(-1)
    pad = labels.eq(IGNORE_INDEX)
    labels = torch.clamp(labels, min=0)
    nll = log_probs.gather(dim=-1, index=labels)
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
    nll.masked_fill_(pad, 0.0)
    smoothed.masked_fill_(pad, 0.0)
    if num_items is None:
        denominator = pad.numel() - pad.long().sum()
    else:
        denominator = num_items.to(nll.device) if torch.is_tensor(num_items) else num_items
    nll = nll.sum() / denominator
    smoothed = smoothed.sum() / (denominator * log_probs.shape[-1])
    return (1 - epsilon) * nll + epsilon * smoothed


def _shifts_labels(lm: nn.Module) -> bool:
    """The Trainer shifts the labels for the model classes transformers maps as causal LMs."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # not a transformers model then: a causal LM by its class name
        return type(lm).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return _model_class(lm).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def use_label_smoother(model: nn.Module, epsilon: float = 0.1) -> Callable[[], None]:
    """Make ``model(**batch)`` run as the Trainer runs it with ``label_smoothing_factor``: the
    forward without the labels, then :func:`label_smoother` over the output's logits, the loss
    divided by the batch's count of kept labels (the Trainer's ``num_items_in_batch``) as
    ``output.loss``. Returns the undo."""
    lm = _base_model(model)
    if "forward" in lm.__dict__:
        raise PlanError(f"loss='hf_smooth' replaces {type(lm).__name__}.forward, which is already replaced")
    own_forward, shift = type(lm).forward, _shifts_labels(lm)

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            raise PlanError("loss='hf_smooth' needs labels in the batch (the Trainer smooths them)")
        items = kwargs.pop("num_items_in_batch", None)
        if items is None:  # the Trainer counts the kept labels of the batch before its step
            items = (labels[..., 1:] if shift else labels).ne(IGNORE_INDEX).sum()
        out = own_forward(self, *args, **kwargs)
        logits = out.get("logits") if isinstance(out, Mapping) else None
        if not isinstance(logits, torch.Tensor):  # the Trainer reads output["logits"] (or output[0] of a tuple)
            raise PlanError(
                f"loss='hf_smooth' smooths the output's logits: {type(lm).__name__[:60]} returned none "
                "(a Hugging Face model's output with 'logits' is needed)"
            )
        out["loss"] = label_smoother(logits, labels, epsilon, shift=shift, num_items=items)
        return out

    lm.forward = types.MethodType(forward, lm)

    def undo() -> None:
        lm.__dict__.pop("forward", None)

    return undo


def apply_loss(loss: str | None, chunk: int | None, workload: Any, batch: Any) -> list[Callable[[], None]]:
    """The undo callbacks of the loss knob on ``workload.model`` (``batch``: the step's batch, after
    the other knobs). ``Plan.apply`` calls it through ``knobs.apply_knobs``."""
    if loss in TRL_LOSSES:
        if workload.loss is not None:
            raise PlanError(f"loss={loss!r} computes TRL's loss in the model's forward: leave Workload.loss unset")
        return [
            use_trl_head(
                workload.model,
                cuda=loss.endswith("cuda"),
                smoothing=0.1 if "smooth" in loss else 0.0,
                valid_hint=_valid_hint(batch),
            )
        ]
    if loss == "hf_smooth":
        if workload.loss is not None:
            raise PlanError(
                "loss='hf_smooth' smooths the model's logits against the batch's labels as the Trainer "
                "does: leave Workload.loss unset"
            )
        return [use_label_smoother(workload.model)]
    if loss != "chunked":
        return []
    if workload.loss is not None:
        raise PlanError(
            "loss='chunked' computes the loss in the model's forward from the batch's labels: "
            "the workload's own loss function would not see logits (leave Workload.loss unset)"
        )
    return [use_chunked_loss(workload.model, chunk or DEFAULT_LOSS_CHUNK, valid_hint=_valid_hint(batch))]
