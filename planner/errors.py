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

    def reworded(self, message: str, min_memory_bytes: int | None = None) -> InfeasiblePlanError:
        """This error with another message (and smallest peak, when given), keeping every fact the
        solver attached to it (`levers`, `proven`, `deterministic_time`)."""
        error = InfeasiblePlanError(message, self.min_memory_bytes if min_memory_bytes is None else min_memory_bytes,
                                    self.lower_bound_bytes)
        error.__dict__.update({k: v for k, v in vars(self).items() if k not in vars(error)})
        return error


class ProfileError(PlannerError, ValueError):
    """A profile database that cannot be used (corrupt, wrong version, other hardware)."""
