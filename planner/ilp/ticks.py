"""The CP-SAT model's integer units: objective ticks (seconds times `_NS`) and memory units (bytes)."""
from __future__ import annotations

_NS = 1e11  # objective unit: 10 picoseconds
_MEM_UNIT = 1  # memory constraint unit: bytes (KiB rounding made a plan at the minimum look infeasible)
