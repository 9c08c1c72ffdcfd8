"""Mesh search: plan one program on several logical mesh shapes and rank them by predicted time.

`plan_parallel(step)` without a mesh and `planner plan --devices N` both search here: the same
candidates, the same per-mesh planning, the same order (fastest first, then the meshes that did
not fit the memory budget, least memory first, then the unusable ones).

`search_meshes` is a loop over steps passing a `state.Search`: build and bound every mesh
(`build.build_meshes`, `build.probe`), solve them by threads on the idle cores in step-time-bound
order, pruning those that cannot be faster, refine the fastest plan on the meshes of three axes
near it, and rank the results.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from planner.core.errors import InfeasiblePlanError, MeshError, OutboundError, PlannerError
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.units import format_bytes
from planner.graph.ir import Graph
from planner.ilp.offload import bounding_problem
from planner.ilp.infeasible import MIN_MEMORY_LIMIT, smallest_peak
from planner.ilp.memory_bounds import memory_lower_bound
from planner.search.build import build_meshes, probe, probe_pool, step_time_lower_bound
from planner.search.cores import solve_threads
from planner.search.mesh_plan import make_plan, plan_problem
from planner.search.refinement import REFINE_UNITS, coarsenings, keeps_together, neighbourhood, refined_choice
from planner.search.results import MeshResult
from planner.search.state import Candidate, Fastest, Search, record

log = logging.getLogger("planner")


def search_meshes(graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                  devices_per_host: int | None = None, devices: Sequence[Any] | None = None,
                  prune: bool = True, threads: int | None = None,
                  min_peak_search: bool = True, beat: float = math.inf) -> tuple[MeshResult, ...]:
    """Plans `graph` on every mesh; returns the results, planned ones fastest first, failures last.

    Without host offload, when the arguments and outputs alone (`memory_bounds.memory_floor`) exceed
    `options.memory_budget` on the devices, only the first mesh's ILP is built (for the smallest
    peak below); the others are over budget without one. The same once the first mesh of a device
    count is built, when the values live at the step's fullest point split over every device
    (`memory_bounds.liveness_floor`) exceed it. Each mesh's ILP is built first and
    bounded before any solver runs: a mesh whose memory lower
    bound (`memory_bounds.memory_lower_bound`; with host offload, the bound of every offload choice)
    exceeds `options.memory_budget` is not solved (an `InfeasiblePlanError` with that bound); the
    others are solved in order of their step-time lower bound (`step_time_lower_bound`, the likely
    best first), and with `prune` a mesh whose bound is not below the fastest plan found so far is
    not solved (`MeshResult.pruned`): it cannot be faster, so the fastest plan is the one planning
    every mesh would give. When no mesh gives a
    plan and some are over budget, the smallest peak is searched on the most promising of them only
    (the least lower bound; `infeasible.smallest_peak`, at most `MIN_MEMORY_LIMIT` deterministic units)
    and recorded in its error; `no_fit_error` turns the results into the user's one-line answer.

    Args:
      graph: the traced program.
      meshes: the logical meshes to try (e.g. `candidate_meshes(n)`).
      options: planner options; with `devices_per_host`, each mesh's `inter_host_axes` are derived
        from its shape instead of taken from `options`.
      devices_per_host: devices per host of a multi-host target (None: `options.inter_host_axes`).
      devices: real devices to bind each plan's `jax.sharding.Mesh` to (None: abstract meshes).
      prune: skip meshes whose step-time lower bound cannot beat the best plan found.
      threads: meshes solved at once (None: the idle cores this process may use, divided by
        `options.solver_workers`, `idle_cores`); the fastest plan is the same for any number.
      min_peak_search: when no mesh gives a plan, search the smallest peak on the most promising
        one (False: a caller trying several programs skips it on all but the last).
      beat: a step time found elsewhere (e.g. a pipeline's): with `prune`, meshes whose lower bound
        is not below it are not solved either.
    """
    search = Search(graph, options, devices, prune, Fastest(beat))
    pool = probe_pool(options, prune, threads)
    search, probes = build_meshes(search, meshes, devices_per_host, pool)
    threads = solve_threads(len(search.candidates), options.solver_workers, threads)
    search = _solve_meshes(probe(search, probes, pool), threads)
    if not search.planned and min_peak_search:
        search = _search_smallest_peak(search)
    return _ranked(_with_mirrors(search), meshes)


def _solve_meshes(search: Search, threads: int) -> Search:
    """Solves the candidates by `threads` workers (CP-SAT releases the GIL while it searches, so
    threads run solves side by side), in phases of one axis count, fewest first (`_solve_phase`);
    the meshes of three or more axes join their phase once built near the fastest plan so far
    (`_refine`). A plan does not depend on the order or on the other solves (one CP-SAT worker,
    deterministic limits), so the fastest plan is the serial search's."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for ndim in sorted({len(c.mesh.shape) for c in search.candidates + search.deferred}):
            if ndim >= 3:
                search = _refine_all(search, ndim)
            search = _solve_phase(search, pool, ndim, threads)
    return search


def _solve_phase(search: Search, pool: concurrent.futures.ThreadPoolExecutor, ndim: int, threads: int) -> Search:
    """Solves the candidates of `ndim` axes, dispatched in step-time-bound order, `threads` at once,
    each pruned against the fastest plan finished by then (`_pruned_by_bound`). The best-bound mesh
    after a probe does not run alone: where the next mesh's bound is close, that mesh is solved
    anyway, and beside it on an idle core instead of after it (Llama-2-70B b128 on 8x8 H100: 16x4's
    37 s after 8x8's 74 s); where it is far, beside it costs the best mesh some wall time waiting for
    the GIL (GPT-3 39B on 8x8 V100 without stages: 8x8 in 23.2 s instead of 14.7; WORKSPACE.md)."""
    queue = sorted((c for c in search.candidates if len(c.mesh.shape) == ndim), key=lambda c: (c.time_bound, c.index))
    running: dict[concurrent.futures.Future, Candidate] = {}
    while queue or running:
        while queue and len(running) < threads:
            cand = queue.pop(0)
            if search.prune and cand.time_bound >= search.fastest.step_time_s:
                search = record(search, _pruned_by_bound(cand, search.fastest.step_time_s))
                continue
            cand, start = _start_of(search, cand) if ndim > 1 else (cand, None)
            running[pool.submit(_solve_one, search, cand, start)] = cand
        if not running:
            break
        finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in finished:
            search = record(search, _same_as_coarse(running.pop(future), future.result()))
    return search


def _pruned_by_bound(cand: Candidate, best: float) -> MeshResult:
    """The result of a mesh not solved: its step-time lower bound is not below `best`."""
    reason = (f"not solved: its step-time lower bound {cand.time_bound:.4g} s is not below the "
              f"{best:.4g} s of a plan found")
    log.info("mesh %s: %s", cand.mesh, reason)
    return MeshResult(cand.mesh, None, None, cand.inter, cand.build_s, pruned=reason, time_bound_s=cand.time_bound)


def _start_of(search: Search, cand: Candidate) -> tuple[Candidate, tuple[int, ...] | None]:
    """The choice a mesh of two or more axes starts from, with the candidate to solve. A mesh
    searched near a plan (`_refine`) starts there, within `REFINE_UNITS`. Another starts from the
    fastest plan of a mesh it refines (`coarsenings`: that plan is one of its plans,
    `refined_choice`), which the solver takes when it ranks before its own greedy start
    (`ilp.solver.solve`: it fits the budget and the greedy does not, or it is faster): under a
    binding budget a 2-D mesh begins from a fitting plan instead of none."""
    if cand.refines is not None:
        coarse, axes = cand.refines
        start = refined_choice(cand.problem, coarse.plan, axes)
        if start is not None:
            cand = dataclasses.replace(cand, options=dataclasses.replace(
                cand.options, solver_time_limit=min(search.options.solver_time_limit, REFINE_UNITS)))
        return cand, start
    start, coarse_time = None, math.inf
    by_shape = {r.mesh.shape: r for r in search.planned}
    for coarse, axes in coarsenings(cand.mesh.shape):
        r = by_shape.get(coarse)
        if r is None or r.plan.prediction.step_time_s >= coarse_time:
            continue
        choice = refined_choice(cand.problem, r.plan, axes)
        if choice is not None:
            start, coarse_time = choice, r.plan.prediction.step_time_s
    return cand, start


def _solve_one(search: Search, cand: Candidate, start: tuple[int, ...] | None = None) -> MeshResult:
    """Plans one mesh (in a worker thread); with `prune`, the solve stops once it proves no plan
    beats the fastest one found meanwhile (`make_plan(beat=...)`)."""
    log.info("planning mesh %s (step time >= %.4g s%s) ...", cand.mesh, cand.time_bound,
             "" if start is None else
             f", a coarser mesh's plan offered as its start, {cand.options.solver_time_limit:.3g} units")
    t0 = time.perf_counter()
    jax_mesh = cand.mesh.to_jax_mesh(search.devices) if search.devices is not None else None
    fastest = search.fastest
    try:
        plan = make_plan(search.graph, cand.mesh, cand.options, jax_mesh, problem=cand.problem, min_peak_search=False,
                         start=start, beat=(lambda: fastest.step_time_s) if search.prune else None)
    except OutboundError as e:  # proven no faster than a plan another mesh found meanwhile
        reason = (f"not solved to the end: the solver proved its step time is at least {e.bound_s:.4g} s, over "
                  f"the {e.beat_s:.4g} s of a plan found")
        log.info("mesh %s: %s (%.3g deterministic units)", cand.mesh, reason, e.deterministic_time)
        return MeshResult(cand.mesh, None, None, cand.inter, cand.build_s + time.perf_counter() - t0,
                          pruned=reason, time_bound_s=cand.time_bound, deterministic_time=e.deterministic_time)
    except (MeshError, PlannerError) as e:
        spent = e.deterministic_time if isinstance(e, InfeasiblePlanError) else None
        log.info("mesh %s: %s (%s deterministic units, %.1fs)", cand.mesh,
                 e if not isinstance(e, InfeasiblePlanError) else "no plan fits the budget"
                 if e.proven else "not decided within the solver limit",
                 "?" if spent is None else f"{spent:.3g}", time.perf_counter() - t0)
        return MeshResult(cand.mesh, None, e, cand.inter, cand.build_s + time.perf_counter() - t0,
                          time_bound_s=cand.time_bound, deterministic_time=spent)
    spent = plan.solver.deterministic_time
    log.info("mesh %s: %.4g s/step, %s/device, planned in %.1fs (%s deterministic units)", cand.mesh,
             plan.prediction.step_time_s, format_bytes(plan.prediction.memory_bytes_per_device),
             time.perf_counter() - t0, spent)
    return MeshResult(cand.mesh, plan, None, cand.inter, cand.build_s + time.perf_counter() - t0,
                      time_bound_s=cand.time_bound, deterministic_time=spent)


def _refine_all(search: Search, ndim: int) -> Search:
    """The deferred meshes of `ndim` (three or more) axes, each built near the fastest plan so far
    when it refines that plan's mesh (`_refine`), added to the candidates."""
    for cand in search.deferred:
        if len(cand.mesh.shape) == ndim:
            search, cand = _refine(search, cand)
            if cand is not None:
                search = dataclasses.replace(search, candidates=search.candidates + (cand,))
    return search


def _refine(search: Search, cand: Candidate) -> tuple[Search, Candidate | None]:
    """Builds the ILP of a mesh of three or more axes over the neighbourhood (`neighbourhood`: the
    plan's specs and those one axis away) of the fastest plan of a mesh it refines; None (and the
    mesh's result recorded) when there is none or the mesh cannot be searched."""
    fastest = min(search.planned, key=lambda r: r.plan.prediction.step_time_s, default=None)
    around = next(((fastest, axes) for coarse, axes in coarsenings(cand.mesh.shape)
                   if fastest is not None and coarse == fastest.mesh.shape), None)
    if around is None:
        reason = ("no plan of fewer axes to search near" if fastest is None else
                  f"3-D meshes are searched near the fastest plan so far (mesh {fastest.mesh}); this one does "
                  "not refine its mesh")
        search = record(search, MeshResult(cand.mesh, None, None, cand.inter, 0.0, pruned=reason))
        log.info("mesh %s: %s", cand.mesh, reason)
        return search, None
    log.info("building the ILP of mesh %s around the plan of mesh %s ...", cand.mesh, around[0].mesh)
    t0 = time.perf_counter()
    try:
        jax_mesh = cand.mesh.to_jax_mesh(search.devices) if search.devices is not None else None
        problem = plan_problem(search.graph, cand.mesh, cand.options, jax_mesh,
                               allowed=neighbourhood(search.graph, around[0].plan, around[1], cand.mesh))
    except (MeshError, PlannerError) as e:
        search = record(search, MeshResult(cand.mesh, None, e, cand.inter, time.perf_counter() - t0))
        log.info("mesh %s: %s", cand.mesh, e)
        return search, None
    cand = dataclasses.replace(cand, problem=problem, refines=around, time_bound=step_time_lower_bound(problem))
    cand = dataclasses.replace(cand, build_s=time.perf_counter() - t0)
    search = dataclasses.replace(search, built={**search.built, cand.mesh: cand})
    budget = search.options.memory_budget
    if budget is not None:
        bound = int(memory_lower_bound(bounding_problem(cand.problem, search.options.planned_offload)).max())
        if bound > budget:  # the neighbourhood holds the coarse plan: only when that is over budget too
            error = InfeasiblePlanError(
                f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {cand.mesh} near the "
                f"plan of mesh {around[0].mesh}: none goes below {format_bytes(bound)} (lower bound; not solved)",
                None, bound)
            return record(search, MeshResult(cand.mesh, None, error, cand.inter, cand.build_s,
                                             time_bound_s=cand.time_bound, over_bound=True)), None
    return search, cand


def _same_as_coarse(cand: Candidate, result: MeshResult) -> MeshResult:
    """`result`, or a pruned record when its plan is its coarse plan again (`_refine`): no faster,
    or every spec keeping the split axes together (a plan of the coarse mesh)."""
    if cand.refines is None or result.plan is None:
        return result
    coarse, axes = cand.refines
    pair = next(fine for fine in axes if len(fine) == 2)
    names = "*".join(cand.mesh.axis_names[a] for a in pair)
    if result.plan.prediction.step_time_s >= coarse.plan.prediction.step_time_s:
        reason = f"its best plan near mesh {coarse.mesh}'s is no faster than that plan"
    elif keeps_together(result.plan, pair):
        reason = f"its best plan uses {names} as one axis everywhere: the plan of mesh {coarse.mesh}"
    else:
        return result
    log.info("mesh %s: %s", cand.mesh, reason)
    return MeshResult(cand.mesh, None, None, cand.inter, result.plan_time_s, pruned=reason,
                      time_bound_s=cand.time_bound, deterministic_time=result.deterministic_time)


def _search_smallest_peak(search: Search) -> Search:
    """No mesh gave a plan: the minimum-peak search on the one over-budget mesh with the least memory
    lower bound (among those whose ILP was built), its result put into that mesh's error."""
    failed, built, options = list(search.failed), search.built, search.options
    over = [(r.lower_bound_bytes if r.lower_bound_bytes is not None else math.inf, built[r.mesh].index, k)
            for k, r in enumerate(failed) if r.over_budget and r.mesh in built]
    if not over:
        return search
    k = min(over)[2]
    r, cand = failed[k], built[failed[k].mesh]
    t0 = time.perf_counter()
    peak = smallest_peak(cand.problem, min(options.solver_time_limit, MIN_MEMORY_LIMIT), options.solver_workers,
                         cand.memory_bound)
    log.info("minimum-peak search on mesh %s: %s in %.1fs", r.mesh,
             "none found" if peak is None else format_bytes(peak), time.perf_counter() - t0)
    old = r.min_memory_bytes
    if peak is not None and (old is None or peak < old):
        error = r.error.reworded(str(r.error), peak)
        failed[k] = dataclasses.replace(r, error=error, plan_time_s=r.plan_time_s + time.perf_counter() - t0)
    return dataclasses.replace(search, failed=tuple(failed))


def _with_mirrors(search: Search) -> Search:
    """The results of the meshes not planned as another mesh's problem (`mirror_key`): that mesh's
    plan (`MeshResult.same_as`), pruning or error."""
    by_mesh = {r.mesh: r for r in search.planned + search.failed + search.pruned}
    mirrors, pruned, failed = [], list(search.pruned), list(search.failed)
    for spec, inter, key in search.twins:
        twin = by_mesh.get(search.keys[key])
        if twin is None:
            continue
        if twin.plan is not None:
            mirrors.append(MeshResult(spec, None, None, inter, 0.0, same_as=twin.mesh))
        elif twin.pruned is not None:
            pruned.append(MeshResult(spec, None, None, inter, 0.0, same_as=twin.mesh, pruned=twin.pruned,
                                     time_bound_s=twin.time_bound_s))
        else:
            failed.append(MeshResult(spec, None, twin.error, inter, 0.0, same_as=twin.mesh))
    return dataclasses.replace(search, mirrors=tuple(mirrors), pruned=tuple(pruned), failed=tuple(failed))


def _ranked(search: Search, meshes: Sequence[MeshSpec]) -> tuple[MeshResult, ...]:
    """The results: planned fastest first, then the mirrors of planned meshes, the meshes not
    solved, and the failures (over budget first, least memory first)."""
    order = {spec: k for k, spec in enumerate(meshes)}
    planned = sorted(search.planned, key=lambda r: (r.plan.prediction.step_time_s, order[r.mesh]))
    pruned = sorted(search.pruned, key=lambda r: order[r.mesh])
    failed = sorted(search.failed, key=lambda r: (not r.over_budget, r.min_memory_bytes or r.lower_bound_bytes or 0,
                                                  order[r.mesh]))
    return tuple(planned + list(search.mirrors) + pruned + failed)
