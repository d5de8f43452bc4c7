"""The Pareto front of (peak, time) points: the ones no other point beats on both."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")

__all__ = ["pareto_front"]


def pareto_front(items: Iterable[T], key: Callable[[T], tuple[float, float]]) -> list[T]:
    """Items not dominated (another item at most as large on both, smaller on one), lowest first
    value first. Ties on both values keep the first item."""
    ordered = sorted(items, key=key)
    front: list[T] = []
    best_second = float("inf")
    for item in ordered:
        _, second = key(item)
        if second < best_second:
            front.append(item)
            best_second = second
    return front
