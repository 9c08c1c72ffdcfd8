"""Exceptions the planner raises on bad input; each names the offending value and the fix."""
from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error the planner raises on purpose."""


class MeshError(PlannerError, ValueError):
    """The mesh does not fit the devices or the program."""


class InvalidArgumentError(PlannerError, TypeError):
    """An argument or option the planner cannot use."""


class InfeasiblePlanError(PlannerError, ValueError):
    """No plan satisfies the constraints (for example the per-device memory budget)."""

    def __init__(self, message: str, min_memory_bytes: int | None = None, lower_bound_bytes: int | None = None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.lower_bound_bytes = lower_bound_bytes  # no plan the planner can choose needs less


class ProfileError(PlannerError, ValueError):
    """A profile database that cannot be used (corrupt, wrong version, other hardware)."""
