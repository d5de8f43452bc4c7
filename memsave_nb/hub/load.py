"""``from_pretrained``: a Hugging Face model as a :class:`~memsave_nb.workload.Workload`, from its
config alone (no weights), with a synthetic batch, LoRA and QLoRA."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from ..workload import Workload
from .bounds import check_config
from .configs import CODE_KEYS, HubError, reason, resolve_config, short
from .lora import apply_lora, lora_config
from .quant import QUANT_TYPES, quantize_linears, skipped_modules

# task -> transformers' auto class and its mapping of model types; the order is the one tried
# when neither ``task`` nor ``config.architectures`` says
TASKS = {
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    "seq-classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
}
_ARCH_SUFFIX = {
    "ForCausalLM": "causal-lm",
    "LMHeadModel": "causal-lm",
    "ForConditionalGeneration": "seq2seq",
    "ForMaskedLM": "masked-lm",
    "ForPreTraining": "masked-lm",
    "ForSequenceClassification": "seq-classification",
    "ForImageClassification": "image-classification",
}
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
DEFAULT_SEQ_LEN = 2048
MAX_TOKENS = 2**27  # batch_size x seq_len: 134M tokens, 16x a 64 x 128k batch; a bound, so a typo is one line
ATTENTION = (
    "sdpa",
    "eager",
)  # what sizing builds with: transformers' default (sdpa, else eager), never a config's choice


def heads(model_type: str) -> list[str]:
    """The tasks this transformers has a head for, for ``model_type``."""
    from transformers.models.auto import modeling_auto

    return [task for task, (_, mapping) in TASKS.items() if model_type in getattr(modeling_auto, mapping)]


def pick_task(config, task: str | None) -> str:
    """``task`` checked against the model's heads, or the one its config names, or the first it has."""
    available = heads(config.model_type)
    if task is not None:
        key = task.lower().replace("_", "-") if isinstance(task, str) else None
        if key not in TASKS:
            raise HubError(f"unknown task {short(task, 40)}; choose from {', '.join(TASKS)}")
        if key not in available:
            raise HubError(
                f"{config.model_type} has no head for task {key!r} in this transformers; it has: {', '.join(available) or 'none'}"
            )
        return key
    for arch in getattr(config, "architectures", None) or []:
        for suffix, named in _ARCH_SUFFIX.items():
            if arch.endswith(suffix) and named in available:
                return named
    if not available:
        raise HubError(f"{config.model_type} has no training head in this transformers (tasks: {', '.join(TASKS)})")
    return available[0]


def parse_dtype(dtype: Any) -> torch.dtype:
    """A floating dtype a model can be built and trained in (an integer dtype cannot hold weights)."""
    if isinstance(dtype, torch.dtype) and dtype in set(DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.lower().removeprefix("torch.")]
    raise HubError(f"unknown dtype {short(dtype, 40)}; choose from bf16, fp16, fp32")


def _seq_limit(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclasses.dataclass(frozen=True)
class SyntheticBatch:
    """The step's synthetic batch as a zero-argument factory (``measure`` calls it inside fake mode).

    Plain data: ``resized(batch_size=8)`` gives the same batch at another size, for a max-batch
    search that keeps the model."""

    task: str
    batch_size: int
    seq_len: int
    dtype: torch.dtype
    vocab_size: int = 2
    num_labels: int = 2
    image_size: int = 224
    num_channels: int = 3

    @classmethod
    def for_config(cls, config, task: str, batch_size: int, seq_len: int, dtype: torch.dtype) -> "SyntheticBatch":
        return cls(
            task,
            batch_size,
            seq_len,
            dtype,
            getattr(config, "vocab_size", None) or 2,
            getattr(config, "num_labels", 2),
            getattr(config, "image_size", 224),
            getattr(config, "num_channels", 3),
        )

    def resized(self, *, batch_size: int | None = None, seq_len: int | None = None) -> "SyntheticBatch":
        return dataclasses.replace(self, batch_size=batch_size or self.batch_size, seq_len=seq_len or self.seq_len)

    def __call__(self, batch_size: int | None = None) -> dict[str, torch.Tensor]:
        """The batch; ``batch_size`` builds it at that size directly (``Plan(batch_size=...)`` and
        the max-batch search pass it: no copy of a smaller batch is repeated)."""
        if batch_size is not None and batch_size != self.batch_size:
            return self.resized(batch_size=batch_size)()
        b, t = self.batch_size, self.seq_len
        if self.task == "image-classification":
            size = self.image_size
            return {
                "pixel_values": torch.randn(b, self.num_channels, size, size, dtype=self.dtype),
                "labels": torch.randint(0, self.num_labels, (b,)),
            }
        ids = torch.randint(0, self.vocab_size, (b, t))
        out = {"input_ids": ids}  # no attention_mask: all ones is no mask, and fake mode cannot read its values
        if self.task == "seq-classification":
            out["labels"] = torch.randint(0, self.num_labels, (b,))
        elif self.task == "seq2seq":
            out["labels"] = torch.randint(0, self.vocab_size, (b, t))  # the model shifts them into decoder_input_ids
        else:
            out["labels"] = ids.clone()  # its own tensor, as a real collator makes it (DataCollatorForLanguageModeling)
        return out


def build_model(config, task: str, dtype: torch.dtype, empty_weights: bool, seed: int):
    """The model from its config: on the meta device (no memory) or with random weights on the CPU."""
    import transformers

    auto = getattr(transformers, TASKS[task][0])
    if task == "seq-classification" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoders' classification heads need it to find the last token
    place = torch.device("meta") if empty_weights else contextlib.nullcontext()
    config._attn_implementation = None  # recursive over sub-configs: no kernel a config names is ever looked up
    with place, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = auto.from_config(config, dtype=dtype, attn_implementation=None)
        except (
            ValueError,
            TypeError,
            RuntimeError,
            AttributeError,
            KeyError,
            IndexError,
            ZeroDivisionError,
            OverflowError,
            AssertionError,
        ) as exc:
            raise HubError(
                f"transformers cannot build {config.model_type} from this config ({type(exc).__name__}: {reason(exc)})"
            ) from exc
    if model.config._attn_implementation not in ATTENTION:
        raise HubError(f"built with attention {short(model.config._attn_implementation, 40)}, not one of {ATTENTION}")
    return model


def _apply_overrides(config, overrides: Any) -> None:
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise HubError(f"overrides= takes a dict of config fields, not {type(overrides).__name__}")
    for key, value in overrides.items():
        if not isinstance(key, str) or not key.isidentifier() or key in CODE_KEYS or key.startswith("_"):
            raise HubError(f"overrides cannot set {short(key, 40)}: give config size fields like num_hidden_layers=2")
        try:
            setattr(config, key, value)
        except Exception as exc:  # noqa: BLE001 - a config property's setter raises anything
            raise HubError(f"overrides cannot set {key[:40]}={short(value, 40)}: {reason(exc)}") from exc


def from_pretrained(
    name_or_path_or_config: Any,
    *,
    task: str | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    dtype: Any = torch.bfloat16,
    lora: Any = None,
    quantize: str | None = None,
    optimizer: Any = "adamw",
    overrides: dict[str, Any] | None = None,
    empty_weights: bool = True,
    revision: str | None = None,
    seed: int = 0,
    sized_for: str | None = "cuda",
) -> Workload:
    """A training-step :class:`Workload` for a Hugging Face model named by hub id, local folder or
    ``config.json``, ``PretrainedConfig``, or catalogue name (:func:`catalogue_names`).

    The model is built from its config alone, on the meta device: measure it with
    ``measure(wl, mode="fake")``. ``empty_weights=False`` builds it with random weights on the CPU
    (small shapes only) for real-mode runs. ``overrides`` changes config fields (e.g. fewer layers).
    ``lora``: a peft ``LoraConfig``, a dict (``r``, ``alpha``, ``target_modules``, ``modules_to_save``,
    ``dropout``) or a string ``"r=16,alpha=32"``. ``quantize``: ``"nf4"`` or ``"int8"`` holds the
    frozen base linears as bitsandbytes does (QLoRA; needs ``lora``). ``sized_for="cuda"`` (the
    default: a model by name is sized for a GPU) makes the step the one torch runs on CUDA where it
    differs from the CPU's (the optimizer's foreach step); None sizes the CPU's step.
    """
    if quantize is not None and (not isinstance(quantize, str) or quantize not in QUANT_TYPES):
        raise HubError(f"unknown quantize {short(quantize, 40)}; choose from {', '.join(QUANT_TYPES)}")
    if quantize is not None and lora is None:
        raise HubError(f"quantize={quantize!r} freezes the base: give lora= too (QLoRA trains the adapters)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_TOKENS:
        raise HubError(f"batch_size must be a whole number from 1 to {MAX_TOKENS:,}, got {short(batch_size, 40)}")
    if not (optimizer is None or callable(optimizer) or isinstance(optimizer, str) and len(optimizer) <= 40):
        raise HubError(
            f"optimizer= takes a name like 'adamw', 'sgd' or 'none', or a function of the parameters; "
            f"got {short(optimizer, 40)}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise HubError(f"seed must be a whole number from 0 to 2**63-1, got {short(seed, 40)}")
    torch_dtype = parse_dtype(dtype)
    config = resolve_config(name_or_path_or_config, revision)
    _apply_overrides(config, overrides)
    check_config(config, torch_dtype.itemsize, bool(empty_weights))
    task = pick_task(config, task)
    limit = _seq_limit(config)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, limit or DEFAULT_SEQ_LEN)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_TOKENS:
        raise HubError(f"seq_len must be a whole number from 1 to {MAX_TOKENS:,}, got {short(seq_len, 40)}")
    if batch_size * seq_len > MAX_TOKENS and task != "image-classification":
        raise HubError(
            f"batch_size x seq_len = {batch_size * seq_len:,} tokens; models by name are sized up to {MAX_TOKENS:,}"
        )
    if limit is not None and seq_len > limit and task != "image-classification":
        raise HubError(f"seq_len {seq_len} is longer than the model's {limit} positions")
    peft_config = None if lora is None else lora_config(lora, task)  # bad settings fail before the build
    model = build_model(config, task, torch_dtype, empty_weights, seed)
    keep = skipped_modules(model) if quantize is not None else ()  # decided on the model as transformers sees it
    if peft_config is not None:
        with torch.device("meta") if empty_weights else contextlib.nullcontext():  # adapters born on meta: no init work
            model = apply_lora(model, peft_config)
    if quantize is not None:
        quantize_linears(model, quantize, keep=keep)
    name = (
        name_or_path_or_config if isinstance(name_or_path_or_config, str) else config.name_or_path or config.model_type
    )
    name = (
        name if len(name) <= 120 else name[:117] + "..."
    )  # a long path: shown in reports, cut like other quoted values
    return Workload(
        model,
        SyntheticBatch.for_config(config, task, batch_size, seq_len, torch_dtype),
        optimizer=optimizer,
        name=name,
        sized_for=sized_for,
    )
