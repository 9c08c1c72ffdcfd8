"""Hooks into XLA's output: reading compiled programs back to measure what the planner predicted."""
from __future__ import annotations

from xla_hooks.inspect import (
    KINDS,
    Collective,
    HloParseError,
    HloReport,
    MemoryStats,
    collectives,
    memory_stats,
    report,
)

__all__ = [
    "KINDS",
    "Collective",
    "HloParseError",
    "HloReport",
    "MemoryStats",
    "collectives",
    "memory_stats",
    "report",
]
