"""Hugging Face lines in a training script: the KV cache off where regions are checkpointed."""

from __future__ import annotations


def cache_off_code(model_var: str) -> list[str]:
    """Lines of a standalone snippet doing what :func:`cache_off` does, on ``model_var``."""
    return [
        "# checkpointed regions and the KV cache (Hugging Face's use_cache) do not mix: turn it off,",
        "# as gradient_checkpointing_enable() does; do not pass use_cache=True to the model in training",
        f"for module in {model_var}.modules():",
        '    config = module.__dict__.get("config")',
        '    if getattr(config, "use_cache", False) is True:',
        "        config.use_cache = False",
    ]
