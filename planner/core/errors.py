"""Exceptions the planner raises on bad input; each names the offending value and the fix."""
from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error the planner raises on purpose."""


class MeshError(PlannerError, ValueError):
    """The mesh does not fit the devices or the program."""


class InvalidArgumentError(PlannerError, TypeError):
    """An argument or option the planner cannot use."""


class OffloadUnavailableError(InvalidArgumentError):
    """Host offload was asked for where it cannot be planned (no host memory space, or no host link
    figure to price the copies); `offload="auto"` then plans without it."""


class InfeasiblePlanError(PlannerError, ValueError):
    """No plan satisfies the constraints (for example the per-device memory budget).

    Attributes (facts for callers that reword or combine the answer; the message already says them):
      min_memory_bytes: the smallest per-device peak of a plan found, when one was measured.
      lower_bound_bytes: a proven bound: no plan the planner can choose needs less.
      proven: False when the solver's limit stopped the search before the budget was ruled out.
      levers: the memory levers and whether each was tried (`planner.ilp.levers.Lever`), when known.
      deterministic_time: CP-SAT deterministic units spent before giving this answer, when known.
    """

    def __init__(self, message: str, min_memory_bytes: int | None = None, lower_bound_bytes: int | None = None,
                 *, proven: bool = True, levers: tuple = (), deterministic_time: float | None = None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.proven = proven
        self.levers = tuple(levers)
        self.deterministic_time = deterministic_time

    def reworded(self, message: str, min_memory_bytes: int | None = None) -> InfeasiblePlanError:
        """This error with another message (and smallest peak, when given), keeping every fact the
        solver attached to it."""
        return InfeasiblePlanError(message, self.min_memory_bytes if min_memory_bytes is None else min_memory_bytes,
                                   self.lower_bound_bytes, proven=self.proven, levers=self.levers,
                                   deterministic_time=self.deterministic_time)


class NotFasterError(InfeasiblePlanError):
    """No mesh gave a plan because each was pruned by a step time to beat (`search_meshes(beat=)`):
    whether a plan fits the budget is not known, only that none beats that time."""


class OutboundError(PlannerError):
    """The solver proved, while searching, that no plan of this problem beats a step time found
    elsewhere (`ilp.solver.solve`'s `beat`): its objective bound reached that time, so the search
    stopped. Not a failure of the input: the mesh search reports the mesh as pruned.

    Attributes:
      bound_s: the proven lower bound on this problem's step time (seconds).
      beat_s: the step time it could not beat.
      deterministic_time: CP-SAT deterministic units spent before stopping.
    """

    def __init__(self, bound_s: float, beat_s: float, deterministic_time: float):
        super().__init__(f"no plan faster than {beat_s:.4g} s/step: the solver proved every plan takes at least "
                         f"{bound_s:.4g} s/step")
        self.bound_s, self.beat_s, self.deterministic_time = bound_s, beat_s, deterministic_time


class ProfileError(PlannerError, ValueError):
    """A profile database that cannot be used (corrupt, wrong version, other hardware)."""


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message ("" when it has none): how a user's own exception (their
    step failing to trace) is quoted in the planner's one-line errors and warnings."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
