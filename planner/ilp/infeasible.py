"""Budgets no plan fits: the smallest peak the planner reaches (the fewest-bytes plan, then a
minimum-peak CP-SAT search) and the errors that report it with the proven lower bound."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from planner.core.errors import InfeasiblePlanError, PlannerError
from planner.core.units import format_bytes
from planner.ilp.cpsat import WALL_CAP_FACTOR, WALL_CAP_FLOOR_S, _Model, _status_words
from planner.ilp.greedy import _min_bytes_choice, _ties_hold
from planner.ilp.levers import RAISE, levers_of, levers_text
from planner.ilp.liveness import memory_profile
from planner.ilp.memory_bounds import memory_lower_bound
from planner.ilp.memory_constraints import _cut_key, _violations
from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes
from planner.ilp.ticks import _MEM_UNIT

log = logging.getLogger("planner")


MIN_MEMORY_LIMIT = 10.0  # deterministic units the minimum-memory search may spend at most


def smallest_peak(problem: Problem, det_limit: float, workers: int = 1,
                  lower_bound: int | None = None) -> int | None:
    """The smallest per-device peak found for `problem`: the fewest-bytes plan's, then (when that
    is above the lower bound and `det_limit` > 0) a minimum-peak CP-SAT search of at most
    `det_limit` deterministic units started from it. None when neither found a plan. `lower_bound`:
    `memory_lower_bound(problem).max()` when the caller has it."""
    lower = int(memory_lower_bound(problem).max()) if lower_bound is None else lower_bound
    best = None
    seed = _min_bytes_choice(problem)
    if _ties_hold(problem, seed):
        best = int(memory_profile(problem, seed).max())
    if det_limit > 0 and (best is None or best > lower):
        found = _min_peak_search(problem, det_limit, workers, seed if best is not None else None)
        if found is not None:
            best = found if best is None else min(best, found)
    return best


def _min_peak_search(problem: Problem, det_limit: float, workers: int, hint: Sequence[int] | None) -> int | None:
    """The smallest liveness peak CP-SAT finds within `det_limit` deterministic units: minimise a
    peak variable bounding the memory at each program point added so far; add the new plan's
    highest point; stop when the solve is optimal and its highest point is already bounded (the
    model's minimum) or the limit is spent. Returns the smallest peak measured, or None."""
    model = _Model(problem)
    total = sum(t.nbytes for t in problem.graph.tensors) // _MEM_UNIT + 1
    peak = model.m.NewIntVar(0, total, "peak")
    model.m.Minimize(peak)
    points: set[tuple] = set()  # the constraints added (`_cut_key`)
    if hint is not None:  # start from the hint's highest points, not an unconstrained model
        for p in _violations(memory_profile(problem, hint), -1, set()):
            model.m.Add(model.memory_expr(p, hint) <= peak)
            points.add(_cut_key(problem, hint, p))
    best = None
    det_used = 0.0
    choice = hint
    for _ in range(20):
        if det_used >= det_limit * 0.999:
            break
        left = det_limit - det_used
        choice, status = model.solve(left, WALL_CAP_FACTOR * left + WALL_CAP_FLOOR_S, workers, choice)
        det_used += model.last.deterministic_time
        if choice is None:
            log.info("minimum-memory search stopped: %s", _status_words(status))
            break
        profile = memory_profile(problem, choice)
        best = int(profile.max()) if best is None else min(best, int(profile.max()))
        top = int(np.argmax(profile))
        if _cut_key(problem, choice, top) in points:
            break  # optimal: the model's minimum; otherwise the limit left no better plan
        model.m.Add(model.memory_expr(top, choice) <= peak)
        points.add(_cut_key(problem, choice, top))
    return best


def _infeasible(problem: Problem, budget: float, time_limit: float, workers: int,
                bound: np.ndarray | None = None, search: bool = True) -> InfeasiblePlanError:
    """The error for a budget no plan fits: the proven lower bound, the smallest peak found
    (`smallest_peak`: the fewest-bytes plan, then with `search` a minimum-peak CP-SAT search of at
    most `MIN_MEMORY_LIMIT` deterministic units), and the levers tried and not available (`LEVERS`)."""
    if bound is None:
        bound = memory_lower_bound(problem)
    lower = int(bound.max())
    mesh = problem.cost.mesh
    on_host = {t for t, _ in problem.offloaded}  # host-offloaded state is not held on the device
    args = sum(min(shard_bytes(problem.graph.tensors[t], s, mesh) for s in set(problem.nodes[problem.owner[t]].owned[t]))
               for t in problem.graph.inputs if t in problem.owner and t not in on_host)
    best = smallest_peak(problem, min(time_limit, MIN_MEMORY_LIMIT) if search else 0.0, workers, lower)
    where = int(np.argmax(bound))
    at = (f"op {where - 1} ({problem.graph.ops[where - 1].primitive})" if 0 < where <= len(problem.graph.ops)
          else "the end of the step")
    found_text = (f"the smallest per-device peak the planner could reach is {_gb(best)}"
                  + (" (the minimum)" if best == lower else "")
                  if best is not None else "no plan was found to measure the smallest reachable peak")
    levers = levers_of(problem)
    error = InfeasiblePlanError(
        f"no plan fits the memory budget of {_gb(budget)} per device on mesh {mesh}: {found_text}; no plan can "
        f"go below {_gb(lower)} (lower bound: {_gb(args)} of {'device-resident ' if on_host else ''}arguments split "
        "over every mesh axis that divides "
        f"them, plus what must be live together at {at}). {levers_text(levers)}. {RAISE}", best, lower, levers=levers,  # the mesh search's one-line answer lists them (`search.results.no_fit_error`)
    )
    return error


def _undecided(problem: Problem, budget: float, time_limit: float, peak: float) -> InfeasiblePlanError:
    """The error when the solver's limit stopped the search before a plan under `budget` was found
    or ruled out (`proven` False: a plan may still fit; `search.results.no_fit_error` says so): the peak of
    the best plan it had, and the proven lower bound."""
    lower = int(memory_lower_bound(problem).max())
    error = InfeasiblePlanError(
        f"no plan fitting {_gb(budget)} per device on mesh {problem.cost.mesh} was found within the solver limit "
        f"({time_limit:.3g} deterministic units); the best plan so far needs {_gb(peak)} (no plan goes below "
        f"{_gb(lower)}); raise solver_time_limit", int(peak), lower, proven=False)
    return error


def _spent(error: PlannerError, deterministic_time: float) -> PlannerError:
    """`error` with the CP-SAT deterministic time spent before it (the mesh search reports it)."""
    if isinstance(error, InfeasiblePlanError):
        error.deterministic_time = deterministic_time
    return error


def _gb(nbytes: float) -> str:
    return format_bytes(nbytes)
