"""The results of a mesh search: one record per mesh, the fastest plan, and the one-line answer when none fits."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.core.errors import InfeasiblePlanError, MeshError, PlannerError
from planner.core.mesh import MeshSpec
from planner.core.plan import Plan
from planner.core.units import format_bytes
from planner.ilp.levers import LEVERS, RAISE, Lever, levers_text


@dataclasses.dataclass(frozen=True, slots=True)
class MeshResult:
    """The outcome of planning on one mesh.

    Attributes:
      mesh: the logical mesh.
      plan: the plan, or None when planning failed or the mesh was not solved.
      error: why planning failed (an `InfeasiblePlanError` when no plan fits the memory budget,
        including a mesh whose memory lower bound alone exceeds it: not solved).
      inter_host_axes: the mesh axes planned over inter-host links.
      plan_time_s: seconds spent planning this mesh.
      same_as: for a mesh not planned because it is another candidate with its axes permuted
        (same axis sizes on the same links: the same problem, `mirror_key`), that candidate.
      pruned: why the mesh was not solved although a plan might fit: its step-time lower bound
        (`step_time_lower_bound`) is not below a plan already found.
      time_bound_s: that lower bound (seconds per step), for the meshes whose ILP was built.
      over_bound: the mesh was not solved because its memory lower bound alone exceeds the budget.
      deterministic_time: CP-SAT deterministic time spent on the mesh (None: not solved, or not known).
    """

    mesh: MeshSpec
    plan: Plan | None
    error: PlannerError | None
    inter_host_axes: tuple[int, ...]
    plan_time_s: float
    same_as: MeshSpec | None = None
    pruned: str | None = None
    time_bound_s: float | None = None
    over_bound: bool = False
    deterministic_time: float | None = None

    @property
    def over_budget(self) -> bool:
        return isinstance(self.error, InfeasiblePlanError)

    @property
    def min_memory_bytes(self) -> int | None:
        """The smallest reachable per-device peak when the mesh is over budget (if the solver found it)."""
        return getattr(self.error, "min_memory_bytes", None)

    @property
    def lower_bound_bytes(self) -> int | None:
        """A proven lower bound on every plan's per-device peak, when the mesh is over budget."""
        return getattr(self.error, "lower_bound_bytes", None)


def no_fit_error(results: Sequence[MeshResult], budget: float | None = None,
                 levers: Sequence[Lever] = LEVERS) -> InfeasiblePlanError:
    """The one-line answer when no mesh of a `search_meshes` result gives a plan and some are over
    the memory budget: the least proven lower bound over the mesh shapes, the smallest peak found
    (and where), which meshes were not solved because their bound alone is over the budget, which
    the solver could not decide within its limit, and the levers (`ilp.levers.LEVERS`)."""
    own = [r for r in results if r.same_as is None]
    levers = next((r.error.levers for r in own if getattr(r.error, "levers", ())), levers)  # solved meshes: no error
    over = [r for r in own if r.over_budget]
    floors = [(r.lower_bound_bytes, r.min_memory_bytes is None, k) for k, r in enumerate(own)
              if r.over_budget and r.lower_bound_bytes is not None]
    found = [(r.min_memory_bytes, k) for k, r in enumerate(own) if r.over_budget and r.min_memory_bytes is not None]
    undecided = [str(r.mesh) for r in own if r.plan is None and r.pruned is None and not isinstance(r.error, MeshError)
                 and (not r.over_budget or not getattr(r.error, "proven", True))]
    unsolved = [str(r.mesh) for r in over if r.over_bound]
    limit = f"the memory budget of {format_bytes(budget)} per device" if budget is not None else "the memory budget"
    shapes = (f"mesh {results[0].mesh}" if len(results) == 1 else
              f"any mesh shape ({', '.join(str(r.mesh) for r in results)})")
    text = (f"does not fit: no plan fits {limit} on {shapes}" if not undecided else
            f"no plan fitting {limit} was found on {shapes}")
    if floors:
        b, _, k = min(floors)
        text += f": needs {format_bytes(b)}/device at best (proven lower bound, mesh {own[k].mesh})"
    if found:
        b, k = min(found)
        text += f"; the smallest peak found is {format_bytes(b)} (mesh {own[k].mesh})"
    if unsolved:
        text += f"; no plan searched on {', '.join(unsolved)} (the lower bound alone is over the budget)"
    if undecided:
        text += (f"; not decided within the solver limit: {', '.join(undecided)} (raise solver_time_limit / "
                 "--time-limit)")
    text += f". {levers_text(levers)}. {RAISE}"
    return InfeasiblePlanError(text, min(found)[0] if found else None, min(floors)[0] if floors else None,
                               levers=levers)


def best_plan(results: Sequence[MeshResult], budget: float | None = None) -> Plan:
    """The fastest plan of a `search_meshes` result.

    Raises:
      InfeasiblePlanError: no mesh gave a plan and some are over the memory budget `budget`
        (`no_fit_error`, one line).
      MeshError: no mesh could be planned (each mesh's reason is listed).
    """
    if results and results[0].plan is not None:
        return results[0].plan
    if any(r.over_budget for r in results):
        raise no_fit_error(results, budget)
    raise MeshError("no mesh shape could be planned:\n  " + "\n  ".join(f"{r.mesh}: {r.error}" for r in results))
