"""What a step was sized for, in words: its batch and sequence ("batch 1 × seq 2048"), and why
"max seq len" cannot search a workload, if it cannot.

A model opened by name carries a synthetic batch (``hub.load.SyntheticBatch``, a factory with
``batch_size`` and ``seq_len``): the explorer says those numbers rather than leaving the user to
guess what was sized. A plan's knobs (``Plan.batch_size`` / ``seq_len``) win over the workload's."""

from __future__ import annotations

from typing import Any

from memsave_nb.errors import MemsaveError


def _factory_shape(batch: Any) -> tuple[int | None, int | None] | None:
    """(batch, seq) of a synthetic batch factory without calling it; None for other factories."""
    n, t = getattr(batch, "batch_size", None), getattr(batch, "seq_len", None)
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    if getattr(batch, "task", None) == "image-classification" or not isinstance(t, int):
        t = None
    return n, t


def batch_shape(workload: Any, plan: Any = None) -> tuple[int | None, int | None]:
    """(batch size, sequence length) of the step the workload runs under ``plan``; None where it
    cannot be told without calling the user's batch function (or there are no token ids)."""
    from memsave_nb.knobs import batch_size_of, seq_len_of

    batch = workload.batch
    n: int | None = None
    t: int | None = None
    shape = _factory_shape(batch) if callable(batch) and not hasattr(batch, "shape") else None
    if shape is not None:
        n, t = shape
    elif not callable(batch) or hasattr(batch, "shape"):
        for fn, slot in ((batch_size_of, 0), (seq_len_of, 1)):
            try:
                value = int(fn(batch))
            except (MemsaveError, TypeError, ValueError):
                continue
            n, t = (value, t) if slot == 0 else (n, value)
    if plan is not None:
        n = getattr(plan, "batch_size", None) or n
        t = (getattr(plan, "seq_len", None) or t) if t is not None else None
    return n, t


def batch_words(workload: Any, plan: Any = None) -> str:
    """ "batch 1 × seq 2048" (or "batch 8" without token ids); "" when neither can be told."""
    n, t = batch_shape(workload, plan)
    parts = ([f"batch {n}"] if n is not None else []) + ([f"seq {t}"] if t is not None else [])
    return " × ".join(parts)


def no_seq_reason(workload: Any) -> str:
    """Why "max seq len" cannot run for this workload ("" when it can: token inputs whose length
    ``Plan.seq_len`` can change, a model by name's synthetic batch included)."""
    from memsave_nb.knobs import seq_len_of

    batch = workload.batch
    if callable(batch) and not hasattr(batch, "shape"):
        shape = _factory_shape(batch)
        if shape is not None:
            return "" if shape[1] is not None else "max seq len: this model's inputs are images (no sequence length)"
        return (
            "max seq len: the batch is a function of yours, so its sequence length cannot be changed from here; "
            "pass the batch itself (a dict or tensor of token ids) to search it"
        )
    try:
        seq_len_of(batch)
    except MemsaveError:  # no token tensors: the knob does not apply
        return "max seq len: the batch has no token-id inputs (no sequence length to change)"
    return ""
