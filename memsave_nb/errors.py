"""Errors a user can act on: each carries a one-line message naming what went wrong and where."""

from __future__ import annotations

from typing import Any


class MemsaveError(Exception):
    """Base class: a problem in the user's setup or step, reported in one line."""


class WorkloadError(MemsaveError, ValueError):
    """The workload cannot describe a training step (bad batch type, non-scalar loss, no device...)."""


class PlanError(MemsaveError, ValueError):
    """A plan that cannot apply to this model (unknown name, bad choice); the message names it."""


class StepError(MemsaveError, RuntimeError):
    """The training step itself failed; the message names the phase and the innermost module."""

    def __init__(self, message: str, *, phase: str = "", module: str = "", cause: BaseException | None = None):
        super().__init__(message)
        self.phase = phase
        self.module = module
        self.cause = cause


class Cancelled(MemsaveError):
    """A run was cancelled by the user; the model has been restored."""


def quoted(value: Any, limit: int = 40) -> str:
    """``repr(value)`` on one line, at most ``limit`` characters: a message quotes a hostile value in
    part, never whole (a 100 kB string stays a one-line error)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails is still named
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def not_one_of(head: str, value: Any, choices: str, limit: int = 199) -> str:
    """``"<head> <value>: choose one of <choices>"`` within ``limit`` characters: the quoted value is
    cut shorter as a list of choices grows (at least 12 characters of it stay)."""
    tail = f": choose one of {choices}"
    room = max(12, limit - len(head) - 1 - len(tail))
    return f"{head} {quoted(value, min(40, room))}{tail}"
