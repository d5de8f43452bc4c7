"""The measurement engine: a storage tracker, ``measure()``, and frozen result records."""

from .engine import measure
from .result import CATEGORIES, Measurement, MemorySplit, ModuleStats, OpStats, Timeline
from .tracker import MemoryTracker

__all__ = ["measure", "Measurement", "MemorySplit", "ModuleStats", "OpStats", "Timeline", "MemoryTracker", "CATEGORIES"]
