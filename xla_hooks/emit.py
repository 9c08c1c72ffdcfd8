"""Applying a plan (`jit_planned`, `constrained_function`); defined in `planner.emit`, re-exported
here beside the hooks that read the compiled program back."""
from __future__ import annotations

from planner.emit import constrained_function, jit_planned

__all__ = ["constrained_function", "jit_planned"]
