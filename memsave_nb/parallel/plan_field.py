"""``Plan.parallel``: a ``ParallelSpec``, or its JSON object; bad values are a one-line ``PlanError``."""

from __future__ import annotations

from typing import Any, Mapping

from .spec import ParallelError, ParallelSpec


def parallel_field(value: Any) -> ParallelSpec:
    from ..checkpointing import PlanError

    try:
        if isinstance(value, ParallelSpec):
            return value
        if isinstance(value, Mapping):
            return ParallelSpec.from_dict(value)
    except (ParallelError, TypeError) as exc:
        raise PlanError(f"plan field 'parallel': {exc}") from None
    raise PlanError(f"plan field 'parallel' must be a ParallelSpec, an object or None, got {value!r}")
