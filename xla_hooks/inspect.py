"""Reads a compiled XLA program back: its collectives, memory and FLOPs.

The planner predicts communication and memory; this module measures what XLA actually emitted,
so the two can be compared. It is a small reader of the HLO text printed by
`jax.stages.Compiled.as_text()` (`hlo_text`), not a full HLO parser: it looks at instruction lines
only. The collectives are read by `hlo_collectives` (their replica groups by `replica_groups`), the
memory by `memory`, kernels and loop trip counts by `computations`; their public names are
importable from here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from xla_hooks.computations import kernels, trip_counts
from xla_hooks.hlo_collectives import KINDS, Collective, collectives, compile_with_program_collectives
from xla_hooks.hlo_text import HloParseError
from xla_hooks.memory import HOST_MEMORY_SPACE, MemoryStats, entry_bytes, memory_analysis, memory_stats

__all__ = ["HOST_MEMORY_SPACE", "KINDS", "Collective", "HloParseError", "HloReport", "MemoryStats", "collectives",
           "compile_with_program_collectives", "entry_bytes", "kernels", "memory_stats", "report", "stage_reports",
           "trip_counts"]


@dataclasses.dataclass(frozen=True, slots=True)
class HloReport:
    """What XLA emitted for one program: collectives, memory and cost-analysis figures."""

    collectives: tuple[Collective, ...]
    memory: MemoryStats | None
    flops: float | None
    bytes_accessed: float | None

    def counts(self) -> dict[str, int]:
        """Number of collectives per kind, in order of first appearance."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def bytes_moved_per_device(self) -> float:
        """Total ring-model bytes each device sends (each static instruction counted once)."""
        return sum(c.bytes_moved_per_device for c in self.collectives)

    def executed_bytes_moved_per_device(self) -> float:
        """Total ring-model bytes each device sends per run: each collective times its loops' known
        trip counts (`Collective.trips`; a scanned model's per-layer collectives run once per layer)."""
        return sum(c.bytes_moved_per_device * c.trips for c in self.collectives)

    def summary(self) -> str:
        """A fixed-width table for logs and experiment reports."""
        lines = [f"{'collective':<20}{'count':>7}{'bytes/device':>16}"]
        for kind, count in self.counts().items():
            moved = sum(c.bytes_moved_per_device for c in self.collectives if c.kind == kind)
            lines.append(f"{kind:<20}{count:>7}{moved:>16,.0f}")
        lines.append(f"{'total':<20}{len(self.collectives):>7}{self.bytes_moved_per_device():>16,.0f}")
        if self.memory is not None:
            m = self.memory
            lines.append(
                f"memory/device: args {m.argument_bytes:,} out {m.output_bytes:,} temp {m.temp_bytes:,}"
                f" alias {m.alias_bytes:,} peak {m.peak_bytes:,}"
            )
        if self.flops is not None:
            lines.append(f"flops/device: {self.flops:,.0f}")
        return "\n".join(lines)


def report(compiled: Any) -> HloReport:
    """Collectives, memory and cost figures of one compiled program (text input: collectives only)."""
    cols = collectives(compiled)
    if isinstance(compiled, str):
        return HloReport(cols, None, None, None)
    memory = memory_analysis(compiled)  # None rather than an error: a report is still useful without it
    get = getattr(compiled, "cost_analysis", None)
    cost = get() if callable(get) else None
    if isinstance(cost, (list, tuple)):  # older JAX returned one dict per program
        cost = cost[0] if cost else None
    cost = cost or {}
    flops, accessed = cost.get("flops"), cost.get("bytes accessed")
    return HloReport(
        cols,
        memory,
        None if flops is None else float(flops),
        None if accessed is None else float(accessed),
    )


def stage_reports(stages: Any) -> tuple[dict[str, HloReport], ...]:
    """Per pipeline stage, the `report` of each of its compiled programs.

    Args:
      stages: what `.lower()` of a pipelined plan returns: per stage an object whose `programs()`
        maps program names ("forward", "backward", "update") to `jax.stages.Lowered`.
    """
    return tuple({name: report(lowered.compile()) for name, lowered in st.programs().items()} for st in stages)
