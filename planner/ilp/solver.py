"""The per-mesh ILP's solve: CP-SAT runs from a heuristic start, with the memory budget enforced
lazily: solve, measure the plan's liveness peak, add a constraint at each violated program point,
solve again (`solve`).

Limits are in CP-SAT's deterministic time (`max_deterministic_time`), so the same problem gives the
same plan on an idle or a loaded machine even when the limit stops the search (with one worker;
several workers race and are not deterministic). `time_limit` is in deterministic units: one unit
is about one second of one core, so `PlanOptions.solver_time_limit` keeps its meaning in seconds
on an idle core. A wall-clock cap (`WALL_CAP_FACTOR` times the limit plus `WALL_CAP_FLOOR_S`
seconds of CP-SAT runs) stops a solve on a machine so loaded that the deterministic limit would
take far longer; a plan stopped by it says so (`Solution.limit`). The cap counts the CP-SAT runs'
own wall time, not the Python work around them (building the model, the memory rounds): that work
waits for the GIL while other threads build their meshes, and counting it left a 0.5-unit
refinement solve of Llama-2-70B's 8x2x4 mesh 0.17 units of search beside another mesh's build.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from planner.core.errors import InfeasiblePlanError, OutboundError, PlannerError
from planner.ilp.cpsat import (
    WALL_CAP_FACTOR,
    WALL_CAP_FLOOR_S,
    _Model,
    _Run,
    _status_words,
    plan_cost,
)
from planner.ilp.greedy import _ties_hold, greedy
from planner.ilp.infeasible import _infeasible, _spent, _undecided
from planner.ilp.liveness import memory_profile
from planner.ilp.local_search import improve, repair
from planner.ilp.memory_bounds import memory_lower_bound, over_budget_strategies
from planner.ilp.memory_constraints import _cut_key, _settled, _violations
from planner.ilp.problem import Problem
from planner.ilp.ticks import _MEM_UNIT, _NS

log = logging.getLogger("planner")

# `solve(beat=...)` stops only when the bound exceeds the time to beat by this fraction: the objective
# sums terms rounded to whole ticks, so it and `plan_cost` may differ by a few ticks per term.
_BEAT_MARGIN = 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class Solution:
    """One strategy index per node, with how it was found.

    Attributes:
      choice: strategy index per node.
      objective_s: predicted communication + compute seconds under the ILP's model.
      status: "optimal", "feasible" (time limit hit; best plan found so far) or "heuristic" (the
        solver found nothing in time; the greedy plan).
      solve_time_s: wall time spent in the solver, all rounds together.
      peak_memory_bytes: per-device liveness peak of the plan.
      rounds: solver rounds (memory constraints are added lazily).
      optimal: CP-SAT proved the plan optimal (under the memory constraints it was given).
      gap: relative gap (objective - best bound) / objective of the last solve; 0 when proven
        optimal, None when the solver gave no bound.
      deterministic_time: CP-SAT deterministic time spent, all rounds together.
      limit: which limit stopped the search: None, "deterministic" or "wall-clock" (the plan then
        depends on the machine's load).
      unbudgeted: when the budget bound (the first round's plan broke it), (step seconds, peak
        bytes, strategies ruled out) of that plan, found with no constraint on live memory but
        without the strategies the memory bound rules out (`over_budget_strategies`, their count):
        what the budget's constraints cost in time.
    """

    choice: tuple[int, ...]
    objective_s: float
    status: str
    solve_time_s: float
    peak_memory_bytes: int
    rounds: int
    optimal: bool = False
    gap: float | None = None
    deterministic_time: float = 0.0
    limit: str | None = None
    unbudgeted: tuple[float, int, int] | None = None


def _fits(problem: Problem, choice: Sequence[int], budget: float | None) -> bool:
    return budget is None or memory_profile(problem, choice).max() <= budget


PROBE_UNITS = 1.0  # deterministic units of `probe_bound`'s run


def probe_bound(problem: Problem, memory_budget: float, units: float = PROBE_UNITS, workers: int = 1) -> float:
    """Seconds per step no plan of `problem` under `memory_budget` goes below, from a short CP-SAT run
    (`units` deterministic units) on the model `solve` starts from: the objective with the strategies
    the memory lower bound rules out (`over_budget_strategies`). `solve`'s later rounds only add
    memory constraints, so the run's bound holds for every plan it can return. Where the budget binds
    this bound is far above `search.build.step_time_lower_bound` (the per-op cheapest strategies ignore
    that ruling out a layout makes its neighbours reshard), so the mesh search can solve the mesh
    with the lowest such bound first and need not solve meshes whose bound is above its plan
    (`search.meshes.search_meshes`). 0 when the run finds no finite bound (an
    infeasible model is left to `solve` to report)."""
    model = _Model(problem)
    model.m.Minimize(model.objective)
    for r, i in over_budget_strategies(problem, memory_budget):
        model.m.Add(model.x[r][i] == 0)
    _, status = model.solve(units, WALL_CAP_FACTOR * units + WALL_CAP_FLOOR_S, workers, None)
    bound = model.last.bound / _NS / (1 + _BEAT_MARGIN)
    return bound if status != cp_model.INFEASIBLE and math.isfinite(bound) and bound > 0 else 0.0


def solve(problem: Problem, memory_budget: float | None = None, time_limit: float = 30.0,
          workers: int = 1, max_rounds: int = 30, min_peak_search: bool = True,
          begin: Sequence[int] | None = None, lp_level: int = 1,
          beat: Callable[[], float] | None = None, gap: float = 0.0) -> Solution:
    """Solves the ILP; with a budget, adds memory constraints until the plan's peak fits.

    `time_limit` is in CP-SAT deterministic units for all rounds together (about one second of one
    idle core each, see the module's docstring); a wall-clock cap of `WALL_CAP_FACTOR` times as many
    seconds plus `WALL_CAP_FLOOR_S` stops the search on an overloaded machine.

    `begin`: a choice to start from (the hint and the fallback) when it beats the greedy one: it
    fits the budget and the greedy does not, or both do (or neither) and it is faster.

    `beat`: the step time (seconds) of a plan found elsewhere, read as the search goes (the mesh
    search's best so far, which other threads lower): once CP-SAT's objective bound in any round
    exceeds it, no plan of this problem can beat that plan (each round's bound holds for the final
    problem: rounds only add constraints), so the search stops with `OutboundError`.

    `lp_level`: CP-SAT's `linearization_level`: 1 (its default) adds the linear constraints to its
    LP relaxation lazily; 2 adds them all with cuts. 2 pays on small ILPs whose overlap term (the
    max-plus chain of `overlap.add_overlap`) the LP must see to bound the objective: the per-layer
    ILPs of the pipeline stage tables (`stages.stage_cost`). It does not pay on whole-model ILPs,
    which keep 1. WORKSPACE.md, Measured.

    `gap`: a relative gap at which each CP-SAT run stops as if proven optimal (its plan is within
    `gap` of the best possible; 0: proven). The per-layer ILPs of the stage tables use
    `stages.layer_cost.LAYER_GAP`: CP-SAT finds their optimum fast and may spend tens of seconds
    proving it.

    Raises:
      InfeasiblePlanError: when no plan fits `memory_budget`; the message, `min_memory_bytes` and
        `lower_bound_bytes` give the smallest per-device peak found and a proven lower bound
        (`min_peak_search=False`: found without the CP-SAT minimum-peak search, `_infeasible`).
    """
    setup = _setup(problem, memory_budget, time_limit, workers, lp_level, beat, min_peak_search, gap)
    state = _start(problem, memory_budget, begin)
    for rounds in range(1, max_rounds + 1):
        state = _round(setup, dataclasses.replace(state, rounds=rounds))
        if state.done:
            break
    return _solution(setup, state)


@dataclasses.dataclass(frozen=True, slots=True)
class _Setup:
    """What every round of `solve` reads: its arguments, the CP-SAT model (memory constraints are
    added to it between rounds) and the strategies the memory lower bound rules out."""

    problem: Problem
    budget: float | None
    time_limit: float
    workers: int
    lp_level: int
    beat: Callable[[], float] | None
    min_peak_search: bool
    gap: float
    start: float  # `time.perf_counter()` when `solve` began
    wall_cap: float
    model: _Model
    excluded: list[tuple[int, int]]


@dataclasses.dataclass(frozen=True, slots=True)
class _State:
    """Where `solve` stands after a round.

    Attributes:
      fallback: the best plan known without the solver (the answer when the limit comes first).
      start_fits: `fallback` keeps its ties and fits the budget.
      hint: the plan the next CP-SAT run starts from (None: no hint).
      choice, profile: the last plan and its memory profile.
      status_name, limit, run, unbudgeted: as `Solution` reports them; `run`: the last CP-SAT run.
      det_used, wall_used: deterministic units and CP-SAT wall seconds spent so far.
      points: the memory constraints added (`memory_constraints._cut_key`).
      rounds: the round number; done: the answer is `choice`.
    """

    fallback: tuple[int, ...]
    start_fits: bool
    hint: tuple[int, ...] | None
    choice: tuple[int, ...] | None = None
    profile: np.ndarray | None = None
    status_name: str = "optimal"
    det_used: float = 0.0
    wall_used: float = 0.0
    limit: str | None = None
    run: _Run | None = None
    unbudgeted: tuple[float, int, int] | None = None
    points: frozenset[tuple] = frozenset()
    rounds: int = 0
    done: bool = False


def _setup(problem: Problem, budget: float | None, time_limit: float, workers: int, lp_level: int,
           beat: Callable[[], float] | None, min_peak_search: bool, gap: float = 0.0) -> _Setup:
    """The model to minimise, without the strategies the memory lower bound rules out; raises when
    that bound alone exceeds the budget (no CP-SAT search for a plan)."""
    start = time.perf_counter()
    wall_cap = WALL_CAP_FACTOR * time_limit + WALL_CAP_FLOOR_S
    if budget is not None:
        bound = memory_lower_bound(problem)
        if bound.max() > budget:  # provably infeasible: no CP-SAT search for a plan
            raise _infeasible(problem, budget, time_limit, workers, bound, min_peak_search)
    model = _Model(problem)
    model.m.Minimize(model.objective)
    excluded: list[tuple[int, int]] = []
    if budget is not None:
        excluded = over_budget_strategies(problem, budget)
        for r, i in excluded:
            model.m.Add(model.x[r][i] == 0)
        if excluded:
            log.info("memory budget: %d of %d strategies ruled out by the lower bound", len(excluded),
                     sum(len(v) for r, v in enumerate(model.x) if problem.rep[r] == r))
    return _Setup(problem, budget, time_limit, workers, lp_level, beat, min_peak_search, gap, start, wall_cap, model,
                  excluded)


def _start(problem: Problem, budget: float | None, begin: Sequence[int] | None) -> _State:
    """The plan the search starts from and falls back on: the greedy plan improved by coordinate
    descent, or `begin` when it is better."""
    fallback = greedy(problem)
    if _ties_hold(problem, fallback):
        fallback = improve(problem, fallback)
    if begin is not None and _ties_hold(problem, begin):
        def rank(choice):  # plans that fit the budget first, then the faster
            return not _fits(problem, choice, budget), plan_cost(problem, choice)
        if not _ties_hold(problem, fallback) or rank(begin) < rank(fallback):
            fallback = tuple(begin)  # a caller's plan (e.g. a coarser mesh's, `search.refinement.refined_choice`) is better
    hint = fallback if _ties_hold(problem, fallback) else None
    start_fits = hint is not None and _fits(problem, fallback, budget)  # the answer when the limit comes first
    return _State(fallback, start_fits, hint)


def _round(setup: _Setup, state: _State) -> _State:
    """One CP-SAT run and what its plan says: the answer, or memory constraints for the next round."""
    state, choice, status = _run(setup, state)
    if choice is None:
        return _without_plan(setup, state, status)
    state = dataclasses.replace(state, choice=choice, profile=memory_profile(setup.problem, choice),
                                status_name=state.status_name if status == cp_model.OPTIMAL else "feasible")
    if setup.budget is None:
        return dataclasses.replace(state, done=True)
    new = _violations(state.profile, setup.budget, _settled(setup.problem, choice, state.points))
    if not new:
        return _within_budget(setup, state, status)
    return _out_of_time(setup, _constrain(setup, state, new))


def _run(setup: _Setup, state: _State) -> tuple[_State, tuple[int, ...] | None, int]:
    """One CP-SAT run from `state.hint` with the limits left: (state, its plan or None, its status).
    Raises `OutboundError` when its bound proves no plan beats `setup.beat`."""
    model, beat = setup.model, setup.beat
    det_left = setup.time_limit - state.det_used
    wall_left = setup.wall_cap - state.wall_used
    choice, status = model.solve(det_left, wall_left, setup.workers, state.hint, setup.lp_level,
                                 None if beat is None else lambda: beat() * _NS * (1 + _BEAT_MARGIN), setup.gap)
    run = model.last
    det_used, wall_used = state.det_used + run.deterministic_time, state.wall_used + run.wall_s
    if model.cut is not None:
        log.info("solver bound %.4g s/step is over the %.4g s/step of a plan found elsewhere: stopped",
                 model.cut[0] / _NS, beat())
        raise OutboundError(model.cut[0] / _NS, model.cut[1] / _NS / (1 + _BEAT_MARGIN), det_used)
    limit = state.limit
    if not run.optimal and status != cp_model.INFEASIBLE:
        limit = "deterministic" if det_used >= setup.time_limit * 0.999 else "wall-clock"
    return dataclasses.replace(state, run=run, det_used=det_used, wall_used=wall_used, limit=limit), choice, status


def _without_plan(setup: _Setup, state: _State, status: int) -> _State:
    """A run that found no plan: the start plan when it fits and the limit came first, else the error."""
    problem, budget, time_limit = setup.problem, setup.budget, setup.time_limit
    if status == cp_model.INFEASIBLE and budget is not None:
        raise _spent(_infeasible(problem, budget, time_limit, setup.workers, search=setup.min_peak_search),
                     state.det_used)
    if status == cp_model.UNKNOWN and state.start_fits:
        log.warning("solver found no plan within its limit (%.3g deterministic units): using the greedy "
                    "plan (raise solver_time_limit for a better one)", time_limit)
        return dataclasses.replace(state, choice=state.fallback, status_name="heuristic",
                                   profile=memory_profile(problem, state.fallback), done=True)
    if status == cp_model.UNKNOWN and budget is not None:  # not decided: no raw status
        peak = state.profile.max() if state.rounds > 1 else memory_profile(problem, state.fallback).max()
        raise _spent(_undecided(problem, budget, time_limit, peak), state.det_used)
    error = InfeasiblePlanError if status == cp_model.INFEASIBLE else PlannerError
    raise _spent(error(f"{_status_words(status)} (solver limit {time_limit:.3g} deterministic units); "
                       "raise solver_time_limit"), state.det_used)


def _within_budget(setup: _Setup, state: _State, status: int) -> _State:
    """A plan every constraint added covers: the answer (or the start plan, when the limit came
    first and it is faster); over the budget still, the error."""
    problem = setup.problem
    if state.profile.max() > setup.budget:
        raise _spent(_infeasible(problem, setup.budget, setup.time_limit, setup.workers,
                                 search=setup.min_peak_search), state.det_used)
    if (state.start_fits and status != cp_model.OPTIMAL
            and plan_cost(problem, state.fallback) < plan_cost(problem, state.choice)):
        # the limit came first and the start is faster: a later round restarted from an
        # over-budget plan and may end slower than the start
        state = dataclasses.replace(state, choice=state.fallback, profile=memory_profile(problem, state.fallback))
    return dataclasses.replace(state, done=True)


def _constrain(setup: _Setup, state: _State, new: list[int]) -> _State:
    """Memory constraints at the points `new` where the plan breaks the budget; the next round starts
    from the plan, repaired to fit the budget when `repair` can."""
    problem, budget, choice = setup.problem, setup.budget, state.choice
    unbudgeted = state.unbudgeted
    if state.rounds == 1:
        unbudgeted = (plan_cost(problem, choice), int(state.profile.max()), len(setup.excluded))
    points = set(state.points)
    for p in new:
        setup.model.m.Add(setup.model.memory_expr(p, choice) <= int(budget // _MEM_UNIT))
        points.add(_cut_key(problem, choice, p))
    # A fitting plan next to this round's plan is a better start than the start plan (a fitting
    # plan far from it): neither won on every mesh tried.
    hint, fallback, start_fits = choice, state.fallback, state.start_fits
    fixed = repair(problem, choice, budget, setup.excluded)
    if fixed is not None:  # a plan under the budget next to this one: the next round starts there
        hint = fixed
        if not start_fits or plan_cost(problem, fixed) < plan_cost(problem, fallback):
            fallback, start_fits = fixed, True
    log.info("memory round %d: peak %.3g B over budget %.3g B, %d constraints%s", state.rounds, state.profile.max(),
             budget, len(points), "" if fixed is None else
             f"; next round from a plan under it ({plan_cost(problem, fixed):.4g} s/step)")
    return dataclasses.replace(state, hint=hint, fallback=fallback, start_fits=start_fits, unbudgeted=unbudgeted,
                               points=frozenset(points))


def _out_of_time(setup: _Setup, state: _State) -> _State:
    """`state` when a limit is left; else the start plan when it fits, or the error."""
    if not (state.det_used >= setup.time_limit * 0.999 or state.wall_used >= setup.wall_cap):
        return state
    if state.start_fits:  # the limit came before a solver plan under the budget, but the start fits: use it
        log.warning("solver found no plan under the budget within its limit (%.3g deterministic units): "
                    "using the best plan under the budget it had (raise solver_time_limit for a better one)",
                    setup.time_limit)
        return dataclasses.replace(state, choice=state.fallback, status_name="heuristic",
                                   profile=memory_profile(setup.problem, state.fallback), done=True)
    raise _spent(_undecided(setup.problem, setup.budget, setup.time_limit, state.profile.max()), state.det_used)


def _solution(setup: _Setup, state: _State) -> Solution:
    """The answer: the plan with its cost, peak, the last run's gap and the limit that stopped it."""
    problem, choice, run, status_name = setup.problem, state.choice, state.run, state.status_name
    elapsed = time.perf_counter() - setup.start
    gap = run.gap() if run is not None else None
    if status_name != "optimal" and run is not None and np.isfinite(run.bound):  # of the plan returned
        obj = plan_cost(problem, choice) * _NS
        gap = max(0.0, (obj - run.bound) / max(obj, 1.0))
    limit = state.limit
    if status_name == "optimal":
        limit = None
    elif limit is not None:
        log.warning("solver %s limit reached: returning the best plan found, not proven optimal (gap %s to the "
                    "best bound)", limit, "unknown" if gap is None else f"{gap:.2%}")
    proven = status_name == "optimal" and not gap  # a run stopped at `solve`'s gap is optimal within it only
    return Solution(tuple(choice), plan_cost(problem, choice), status_name, elapsed, int(state.profile.max()),
                    state.rounds, proven, gap, state.det_used, limit, state.unbudgeted)
