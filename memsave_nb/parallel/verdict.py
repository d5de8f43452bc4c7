"""Does a rank fit the GPU: ``target.fit_of``'s per-rank twin.

Where the rank's step was replayed (``RankMeasurement.reserved``), the verdict is the replay's:
predicted reserved memory + CUDA context + one set of communication buffers per communicator
against the whole GPU, the replay run again under that capacity with FSDP2's streams apart
(``replay.py``), pipeline stages included. Where it was not (ranks rebuilt by the cross-check,
the layout search's shallow twins), the 80% rule on the device peak, and the ``Fit`` says which
rule decided.
"""

from __future__ import annotations

from typing import Any

from ..target import RULE_80, RULE_REPLAY, Fit, ReservedVerdict, Target, verdict_of_replay
from .replay import fits

__all__ = ["rank_fit", "rank_verdict", "worst_fit"]


def rank_verdict(target: Target, rank: Any, *, communicators: int = 0, fixes: bool = True) -> ReservedVerdict | None:
    """The allocator replay's verdict for one rank, or None where the rank has no replay."""
    r = getattr(rank, "reserved", None)
    if r is None or not r.ops:
        return None
    streams = getattr(rank, "reserved_streams", ())
    return verdict_of_replay(
        target,
        r,
        lambda conf, capacity: fits(r.ops, streams, conf, capacity),
        communicators=communicators,
        fixes=fixes,
    )


def rank_fit(target: Target, rank: Any, *, communicators: int = 0, fixes: bool = True) -> Fit:
    """``fit_of`` for one ``RankMeasurement``: the replay's verdict where it has one, else the 80%
    rule on its device peak (``device_bytes``)."""
    replay = rank_verdict(target, rank, communicators=communicators, fixes=fixes)
    if replay is not None:
        return Fit(replay.fits, RULE_REPLAY, rank.device_bytes, replay)
    return Fit(target.fits(rank.device_bytes), RULE_80, rank.device_bytes)


def worst_fit(target: Target, result: Any, *, fixes: bool = True) -> tuple[Any, Fit]:
    """The rank that decides a ``ParallelMeasurement``'s verdict, and its ``Fit``: a rank that does
    not fit first, then the largest predicted total (replay) or device peak (rule)."""
    n = result.spec.communicators if result.spec.world_size > 1 else 0
    fitted = [(r, rank_fit(target, r, communicators=n, fixes=fixes)) for r in result.ranks]

    def weight(pair: tuple[Any, Fit]) -> tuple:
        r, f = pair
        total = f.replay.total_bytes if f.replay is not None else r.device_bytes
        return (not f.fits, total, -r.rank)

    return max(fitted, key=weight)
