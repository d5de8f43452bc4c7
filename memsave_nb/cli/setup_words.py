"""The setup in words for a report's title: LoRA / QLoRA and the sequence length of a Hugging
Face model ("llama-3.1-8b, LoRA r=16, seq 2048"), so a title read alone says what was sized."""

from __future__ import annotations

import argparse
from typing import Any


def setup_words(args: argparse.Namespace, workload: Any, hub: bool) -> str:
    """``", LoRA r=16, seq 2048"`` (empty for a demo model: its name says its batch's shape)."""
    if not hub:
        return ""
    words = []
    lora = getattr(args, "lora", None)
    if lora:
        kind = f"QLoRA {args.quantize}" if getattr(args, "quantize", None) else "LoRA"
        words.append(f"{kind} {lora}")
    seq = getattr(getattr(workload, "batch", None), "seq_len", None)
    if isinstance(seq, int) and getattr(workload.batch, "task", "") != "image-classification":
        words.append(f"seq {seq}")
    return "".join(f", {w}" for w in words)
