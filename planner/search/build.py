"""Building and bounding every mesh of a search before any solver runs: its ILP, its memory and
step-time lower bounds, the memory floors of its device count, and the probes that order the meshes
under a binding budget."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Sequence

from planner.core.errors import InfeasiblePlanError, MeshError, PlannerError
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.units import format_bytes
from planner.ilp.offload import bounding_problem, offloadable_pairs
from planner.ilp.problem import Problem
from planner.ilp.levers import LEVERS, levers_of
from planner.ilp.memory_bounds import liveness_floor, memory_floor, memory_lower_bound, over_budget_strategies
from planner.ilp.solver import PROBE_UNITS, probe_bound
from planner.cost_model.topology import is_topology
from planner.search.candidates import inter_host_axes, mirror_key
from planner.search.cores import idle_cores
from planner.search.mesh_plan import donated_inputs, plan_problem
from planner.search.results import MeshResult
from planner.search.state import Candidate, Search, record

log = logging.getLogger("planner")

Probes = tuple[tuple[Candidate, concurrent.futures.Future], ...]


def step_time_lower_bound(problem: Problem) -> float:
    """Seconds per step no plan of `problem` goes below: per node, its cheapest strategy's cost less
    the part of its collectives that may hide behind compute (`Node.async_s`), summed.

    Sound for `objective.step_time`, the number the plan reports: its total is the nodes' costs
    (compute + own collectives), plus combined latencies and edge resharding (both >= 0), less the
    hidden part, which is at most the nodes' hideable collectives plus the prefetched edges'
    resharding plus the host-offload copies in, each hidden at most whole (`objective.hidden_time`).
    Cheap: one pass over the built ILP, no solver."""
    return float(sum(min((c - a for c, a in zip(n.costs, n.async_s)), default=0.0) for n in problem.nodes))


def probe_pool(options: PlanOptions, prune: bool, threads: int | None) -> concurrent.futures.ThreadPoolExecutor | None:
    """The threads that probe the meshes under a binding budget (`probe`), when the search prunes
    against a budget without host offload; they run beside the builds of the next meshes (CP-SAT
    leaves the GIL to them)."""
    if not (prune and options.memory_budget is not None and options.planned_offload == "off"):
        return None
    return concurrent.futures.ThreadPoolExecutor(max(1, threads or idle_cores() // max(1, options.solver_workers)))


def build_meshes(search: Search, meshes: Sequence[MeshSpec], devices_per_host: int | None,
                 pool: concurrent.futures.ThreadPoolExecutor | None) -> tuple[Search, Probes]:
    """Builds and bounds every mesh in order (`search_meshes`): each becomes a candidate to solve,
    a mesh of three or more axes deferred, or a result (another mesh's problem, over the budget,
    or not buildable). Returns the search and the probes started on `pool` (`probe`)."""
    budget = search.options.memory_budget
    probes: Probes = ()
    for k, spec in enumerate(meshes):
        inter = inter_host_axes(spec.shape, devices_per_host) if devices_per_host else search.options.inter_host_axes
        search, cand = _admit(search, k, spec, inter)
        if cand is None:
            continue
        if len(spec.shape) >= 3:  # searched around the best plan of a mesh it refines, once that is known
            search = dataclasses.replace(search, deferred=search.deferred + (cand,))
            continue
        search, cand = _build(search, cand, len(meshes))
        if cand is None:
            continue
        search = dataclasses.replace(search, candidates=search.candidates + (cand,))
        if pool is not None and len(spec.shape) >= 2 and over_budget_strategies(cand.problem, budget):
            probes += ((cand, pool.submit(probe_bound, cand.problem, budget, PROBE_UNITS,
                                          search.options.solver_workers)),)
    return search, probes


def _admit(search: Search, k: int, spec: MeshSpec, inter: tuple[int, ...]) -> tuple[Search, Candidate | None]:
    """Mesh `k` as a candidate, or None (recorded) when it is another mesh with its axes permuted
    (`mirror_key`) or the memory floor of its device count is over the budget."""
    options = search.options
    # a topology prices a permuted mesh's axes otherwise (row-major over a torus): no twins there
    key = mirror_key(spec, inter) if options.profile is None and not is_topology(options.hardware) else None
    if key is not None and key in search.keys:
        log.info("mesh %s: the problem of mesh %s with its axes permuted; not planned again", spec, search.keys[key])
        return dataclasses.replace(search, twins=search.twins + ((spec, inter, key),)), None
    if key is not None:
        search = dataclasses.replace(search, keys={**search.keys, key: spec})
    search, over = _over_floor(search, spec, inter)
    if over:
        return search, None
    return search, Candidate(k, spec, inter, dataclasses.replace(options, inter_host_axes=inter))


def _over_floor(search: Search, spec: MeshSpec, inter: tuple[int, ...]) -> tuple[Search, bool]:
    """The memory floor of `spec`'s device count: computed at its first mesh (built regardless, so
    that the answer can give the smallest peak of a plan found); True (the mesh recorded as over
    budget, no ILP to build) when a later mesh's floor is over the budget."""
    graph, options, budget = search.graph, search.options, search.options.memory_budget
    floor, floor_words = search.floors.get(spec.size, (None, ""))
    if floor is None and budget is not None and options.planned_offload == "off":
        floor = memory_floor(graph, spec.size, donated_inputs(graph, options.donate_argnums))
        search = dataclasses.replace(
            search, floors={**search.floors, spec.size: (floor, "its arguments and outputs split over every device")})
        log.info("every plan on %d devices needs >= %s/device (arguments and outputs)", spec.size,
                 format_bytes(floor))
        return search, False
    if floor is not None and floor > budget:
        error = InfeasiblePlanError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {spec}: no plan can go "
            f"below {format_bytes(floor)} ({floor_words}; not solved)",
            None, floor, levers=_floor_levers(graph, options))
        search = record(search, MeshResult(spec, None, error, inter, 0.0, over_bound=True))
        log.info("mesh %s: needs >= %s/device, over the budget: not built", spec, format_bytes(floor))
        return search, True
    return search, False


def _floor_levers(graph, options: PlanOptions) -> tuple:
    """`LEVERS` with those a device count's memory floor counted marked tried: donating the train
    state (where the step donates it) and host offload (where it is planned)."""
    used = {"donating the train state": bool(donated_inputs(graph, options.donate_argnums)),
            "host offload": options.planned_offload != "off"}
    return tuple(dataclasses.replace(v, state="tried") if used.get(v.name) else v for v in LEVERS)


def _build(search: Search, cand: Candidate, count: int) -> tuple[Search, Candidate | None]:
    """Builds the ILP of `cand` (mesh `cand.index` of `count`) and bounds it: its step-time lower
    bound, the liveness floor of its device count (`_liveness_floor`), its memory lower bound (with
    host offload, the bound of every offload choice, `ilp.offload.bounding_problem`); None (recorded)
    when it cannot be built or that bound is over the budget."""
    spec, budget = cand.mesh, search.options.memory_budget
    log.info("building the ILP of mesh %s (%d/%d) ...", spec, cand.index + 1, count)
    t0 = time.perf_counter()
    try:
        jax_mesh = spec.to_jax_mesh(search.devices) if search.devices is not None else None
        problem = plan_problem(search.graph, spec, cand.options, jax_mesh)
    except (MeshError, PlannerError) as e:
        search = record(search, MeshResult(spec, None, e, cand.inter, time.perf_counter() - t0))
        log.info("mesh %s: %s", spec, e)
        return search, None
    cand = dataclasses.replace(cand, problem=problem, time_bound=step_time_lower_bound(problem))
    search = _liveness_floor(search, cand)
    if budget is not None:
        bounding = bounding_problem(cand.problem, search.options.planned_offload)
        cand = dataclasses.replace(cand, memory_bound=int(memory_lower_bound(bounding).max()))
    cand = dataclasses.replace(cand, build_s=time.perf_counter() - t0)
    search = dataclasses.replace(search, built={**search.built, spec: cand})
    if cand.memory_bound is not None and cand.memory_bound > budget:
        error = InfeasiblePlanError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {spec}: no plan can go "
            f"below {format_bytes(cand.memory_bound)} (lower bound; not solved)", None, cand.memory_bound)
        error.levers = levers_of(bounding)  # the levers the bound counted (`results.no_fit_error` lists them)
        search = record(search, MeshResult(spec, None, error, cand.inter, cand.build_s, time_bound_s=cand.time_bound,
                                           over_bound=True))
        log.info("mesh %s: needs >= %s/device, over the budget: not solved", spec, format_bytes(cand.memory_bound))
        return search, None
    return search, cand


def _liveness_floor(search: Search, cand: Candidate) -> Search:
    """At the first built mesh of a device count: the values live at the step's fullest point split
    over every device (`memory_bounds.liveness_floor`; with host offload, without every value an
    offload choice may keep on the host), the floor of the later meshes of that count (before they
    are built) when it is higher than the one known (offload has none before it: its arguments may
    leave the device)."""
    options, size = search.options, cand.mesh.size
    floor = search.floors.get(size, (None, ""))[0]
    offload = options.planned_offload
    if options.memory_budget is None or size in search.lived or (offload == "off" and floor is None):
        return search
    search = dataclasses.replace(search, lived=search.lived | {size})
    away = {t for pair in offloadable_pairs(cand.problem, offload) for t in pair if t >= 0}
    live = liveness_floor(cand.problem, away)
    if floor is None or live > floor:
        words = "the values live at the step's fullest point split over every device" + (
            "" if offload == "off" else ", every offloadable leaf on the host")
        search = dataclasses.replace(search, floors={**search.floors, size: (live, words)})
        log.info("every plan on %d devices needs >= %s/device (%s)", size, format_bytes(live),
                 "the values live at the fullest point" if offload == "off"
                 else "the values live at the fullest point, every offloadable leaf on the host")
    return search


def probe(search: Search, probes: Probes, pool: concurrent.futures.ThreadPoolExecutor | None) -> Search:
    """Raises the step-time bound of each mesh of two or more axes whose memory budget binds (the
    memory lower bound rules strategies out) to `solver.probe_bound`'s, when there are several such
    meshes to order: the search then solves them best bound first and prunes those whose bound is not
    below a plan found (under such a budget the per-op bounds of those meshes are nearly equal and
    order them no better than chance). `probes`: those meshes with their probes, started as each
    mesh was built (`build_meshes`)."""
    if pool is None:
        return search
    pool.shutdown(wait=True)
    if len(probes) < 2:
        return search
    raised = {}
    for cand, future in probes:
        bound = future.result()
        log.info("mesh %s: step time >= %.4g s under the budget (%.3g-unit probe; %.4g s without it)",
                 cand.mesh, bound, PROBE_UNITS, cand.time_bound)
        raised[cand.index] = dataclasses.replace(cand, time_bound=max(cand.time_bound, bound))
    return dataclasses.replace(search, candidates=tuple(raised.get(c.index, c) for c in search.candidates),
                               built={m: raised.get(c.index, c) for m, c in search.built.items()})
