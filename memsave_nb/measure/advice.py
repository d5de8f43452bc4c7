"""One-line hints a measurement carries: outputs that stay alive to the end of the step, autocast's
weight copies."""

from __future__ import annotations

from ..workload import Workload, output_dropped
from .result import OpStats

# A part of the output gets a hint when it holds at least this share of what the step keeps at the
# end of forward (saved for backward + outputs); a KV cache from 1% on (turning it off costs nothing
# in training).
ADVICE_SHARE = 0.10
ADVICE_SHARE_CACHE = 0.01
_CACHE_PARTS = ("past_key_values", "present_key_values", "mems", "cache")


def advice_for(
    parts: tuple[tuple[str, int], ...], kept_bytes: int, peak_bytes: int, loop: str = "keep_output_step"
) -> tuple[str, ...]:
    """One-line hints for outputs that keep much memory to the end of the step, and what frees them.

    ``kept_bytes``: saved for backward plus outputs at the end of forward; a part gets a hint when
    it holds at least ``ADVICE_SHARE`` of it. Under the ``loss_only`` loop the outputs already go
    before backward: only the KV cache (alive with the activations at the end of forward) gets one."""
    hints = []
    for name, nbytes in parts:
        if output_dropped(loop, "backward") and name not in _CACHE_PARTS:
            continue
        share_needed = ADVICE_SHARE_CACHE if name in _CACHE_PARTS else ADVICE_SHARE
        if peak_bytes <= 0 or kept_bytes <= 0 or nbytes < share_needed * kept_bytes:
            continue
        size = _mib(nbytes)
        share = f"{nbytes / peak_bytes:.0%} of the peak"
        if name in _CACHE_PARTS:
            hints.append(f"use_cache=False frees the KV cache ({size}, {share}): training does not need it")
        elif name == "logits":
            hints.append(
                f"the logits stay alive to the end of the step ({size}, {share}): keep only the loss "
                "(loss = model(**batch).loss), compute the loss inside the model or use a chunked cross-entropy (Plan(loss='chunked'))"
            )
        elif name != "loss":
            hints.append(
                f"the output {name!r} stays alive to the end of the step ({size}, {share}): drop it after the loss if training does not need it"
            )
    return tuple(hints)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def autocast_advice(workload: Workload, ops: tuple[OpStats, ...], saved_bytes: int) -> tuple[str, ...]:
    """Under ``torch.autocast`` each matmul saves the low-precision copies of its operands that
    autocast made (``aten._to_copy``), weights included: a model of large weights and small batches
    can keep more than in fp32. One hint when those copies are a large share of what is saved."""
    if getattr(workload, "autocast_dtype", None) is None or saved_bytes <= 0:
        return ()
    casts = sum(o.saved_bytes for o in ops if o.op == "aten._to_copy")
    if casts < ADVICE_SHARE * saved_bytes:
        return ()
    return (
        f"{_mib(casts)} ({casts / saved_bytes:.0%} of the saved bytes) are autocast's low-precision copies of weights "
        "and inputs (aten._to_copy), kept for backward; parameters held in bf16 (precision 'bf16' or 'bf16_master') "
        "need no weight copies",
    )
