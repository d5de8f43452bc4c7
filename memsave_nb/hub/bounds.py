"""Checks on a config before anything is built: sizes that are whole numbers >= 1, and a cost
estimate refused above stated bounds (``num_hidden_layers: 10**6`` would build for hours).

The estimate is a formula over the config's own numbers (layers, width, vocabulary, experts), read
from ``to_dict()`` so aliases are not counted twice; sub-configs (T5's decoder, a VLM's text and
vision towers) add up. It is an upper-ish bound to refuse absurd configs, not a parameter count.
"""

from __future__ import annotations

from typing import Any

from .configs import HubError, short

MAX_LAYERS = 1024  # blocks in all towers; ~1k tiny blocks build on meta in seconds; the largest real models have < 200
MAX_PARAMS = 10**13  # estimated parameters on the meta device (10x the largest published models)
MAX_REAL_BYTES = 4 * 2**30  # estimated weight bytes with empty_weights=False (real tensors in this process)
MAX_DIM = 2**31 - 1  # one size: torch kernels index with 32-bit ints in places

# sizes that must be whole numbers >= 1 where a config holds them (None: the model's default)
SIZE_KEYS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "n_positions",
        "n_ctx",
        "d_model",
        "d_ff",
        "d_kv",
        "num_heads",
        "num_layers",
        "num_decoder_layers",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "image_size",
        "patch_size",
        "num_channels",
        "embedding_size",
        "moe_intermediate_size",
    }
)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # 0 or None: a dense model
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


def _first(node: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = node.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _check_size(key: str, value: Any, where: str, least: int) -> None:
    values = value if isinstance(value, (list, tuple)) and key in ("image_size", "patch_size") else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not least <= v <= MAX_DIM:
            raise HubError(
                f"config {where}{key} must be a whole number from {least} to {MAX_DIM:,}, got {short(value, 40)}"
            )


def _nodes(data: dict[str, Any], where: str = ""):
    yield where, data
    for key, value in data.items():
        if isinstance(value, dict) and not key.endswith(("id2label", "label2id")):
            yield from _nodes(value, f"{where}{key}.")


def check_config(config, dtype_bytes: int, empty_weights: bool) -> int:
    """Refuse bad sizes and configs over the bounds (one line each); return the parameter estimate."""
    data = config.to_dict()
    layers = params = 0
    for where, node in _nodes(data):
        for key, value in node.items():
            if value is not None and key in SIZE_KEYS:
                _check_size(key, value, where, 1)
            elif value is not None and key in EXPERT_KEYS:
                _check_size(key, value, where, 0)
        depth = sum(node[k] for k in LAYER_KEYS if isinstance(node.get(k), int) and not isinstance(node.get(k), bool))
        width = _first(node, "hidden_size", "n_embd", "d_model")
        inner = _first(node, "intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim") or 4 * width
        experts = _first(node, *EXPERT_KEYS)
        expert_inner = _first(node, "moe_intermediate_size") or inner
        vocab, positions = _first(node, "vocab_size"), _first(node, "max_position_embeddings", "n_positions")
        layers += depth
        params += (
            2 * vocab * width
            + positions * width
            + depth * (4 * width * width + 3 * width * inner + experts * 3 * width * expert_inner)
        )
    if layers > MAX_LAYERS:
        raise HubError(
            f"config has {layers:,} layers; models by name are built up to {MAX_LAYERS:,} "
            "(a build this deep would not finish): lower num_hidden_layers"
        )
    if params > MAX_PARAMS:
        raise HubError(
            f"config estimates {params:.3g} parameters; models by name are built up to {MAX_PARAMS:.0e}: "
            "check its sizes (hidden_size, vocab_size, experts)"
        )
    if not empty_weights and params * dtype_bytes > MAX_REAL_BYTES:
        raise HubError(
            f"random weights would take about {params * dtype_bytes / 2**30:.3g} GiB here (limit "
            f"{MAX_REAL_BYTES / 2**30:.0f} GiB): use empty_weights=True and measure in fake mode"
        )
    return params
