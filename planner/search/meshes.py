"""Mesh search: plan one program on several logical mesh shapes and rank them by predicted time.

`plan_parallel(step)` without a mesh and `planner plan --devices N` both search here: the same
candidates, the same per-mesh planning, the same order (fastest first, then the meshes that did
not fit the memory budget, least memory first, then the unusable ones).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from planner.cost_model import Cluster
from planner.core.errors import InfeasiblePlanError, MeshError, OutboundError, PlannerError
from planner.graph.trace import Graph
from planner.ilp.problem import Problem
from planner.ilp.solver import (LEVERS, MIN_MEMORY_LIMIT, PROBE_UNITS, Lever, levers_of, levers_text,
                                liveness_floor, memory_floor, memory_lower_bound, over_budget_strategies,
                                probe_bound, smallest_peak)
from planner.core.mesh import MeshSpec, default_axis_names
from planner.core.sharding import active_axes
from planner.ilp.offload import bounding_problem
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.search.mesh_plan import donated_inputs, make_plan, plan_problem
from planner.core.units import format_bytes

log = logging.getLogger("planner")


REFINE_UNITS = 0.5  # deterministic units of a neighbourhood search on a mesh of three axes (`search_meshes`)


def candidate_meshes(num_devices: int, max_ndim: int = 2) -> list[MeshSpec]:
    """Logical mesh shapes to try when the user gives none: (n,), every 2-D factorisation, and with
    `max_ndim=3` every 3-D one with axes of at least 2 (e.g. data x fsdp x tensor)."""
    out = [MeshSpec((num_devices,), default_axis_names(1))]
    divisors = [a for a in range(2, num_devices) if num_devices % a == 0]
    if max_ndim >= 2:
        out += [MeshSpec((a, num_devices // a), default_axis_names(2)) for a in divisors]
    if max_ndim >= 3:
        out += [MeshSpec((a, b, num_devices // (a * b)), default_axis_names(3)) for a in divisors for b in divisors
                if num_devices % (a * b) == 0 and num_devices // (a * b) >= 2]
    return out


def default_mesh_ndim(mesh_ndim: int | None, hosts: int) -> int:
    """The most mesh axes a search tries: `mesh_ndim` when given, else 3 for devices on several
    hosts (where a third axis lets, e.g., the batch cross hosts while parameters are split over part
    of each host and the tensor dimensions over the rest), 2 on one host (measured: searching
    2x2x2 adds about 30% to gpt2-small's 8-device search and its answer was the 2x4 plan)."""
    return mesh_ndim if mesh_ndim is not None else 3 if hosts > 1 else 2


def coarsenings(shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
    """The meshes of one fewer axis a mesh refines, by merging two neighbouring axes: (coarse shape,
    for each coarse axis the fine axes it becomes). A plan on the coarse mesh is a plan on the fine
    one: splitting a dimension over the merged axis is splitting it over the two axes in order
    (devices laid out row-major, the same devices in the same order)."""
    out = []
    for k in range(len(shape) - 1):
        coarse = tuple(shape[:k]) + (shape[k] * shape[k + 1],) + tuple(shape[k + 2:])
        axes = tuple((a,) for a in range(k)) + ((k, k + 1),) + tuple((a + 1,) for a in range(k + 1, len(shape) - 1))
        out.append((coarse, axes))
    return out


def refined_choice(problem: Problem, plan: Plan, axes: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    """`plan` (made on a coarser mesh, `coarsenings`) as a choice of `problem`'s strategies: each
    decision takes the strategy that makes its results in the plan's shardings and reads its
    operands as the plan reads them, every coarse axis replaced by its fine axes (the cheapest such
    strategy, or of those making the results alike when none reads alike). None when some decision
    has no strategy making its results in the plan's shardings."""
    graph = problem.graph

    def fine(spec):
        return tuple(tuple(f for a in dim for f in axes[a]) for dim in spec)

    made = {t: fine(spec) for t, spec in zip(graph.inputs, plan.input_specs)}
    for op, k, spec in plan.op_specs:
        made[graph.ops[op].outputs[k]] = fine(spec)
    read = {(op, pos): fine(spec) for op, pos, spec in plan.operand_specs}
    choice = []
    for node in problem.nodes:
        alike = [j for j in range(len(node.costs))
                 if all(t not in made or specs[j] == made[t] for t, specs in node.owned.items())]
        if not alike:
            return None
        root = node.ops[0] if node.ops else None
        same = [j for j in alike if all(specs[j] == read.get((root, pos), made.get(t, specs[j]))
                                        for t, specs, pos in node.requires)]
        choice.append(min(same or alike, key=lambda j: node.costs[j]))
    return tuple(choice)


def neighbourhood(graph: Graph, plan: Plan, axes: Sequence[tuple[int, ...]], mesh: MeshSpec) -> dict[int, frozenset]:
    """The specs a finer mesh's search keeps near `plan` (made on the coarser mesh, `coarsenings`):
    per tensor the plan lays out, its spec (and the specs its readers read it in) with every
    coarse axis replaced by its fine axes (as `refined_choice` maps them), and every spec one
    active axis of `mesh` away from those (the axis taken out, moved to another dim, or added to a
    dim it did not split). Over these, `ilp.problem.build_problem(allowed=...)` builds a small ILP
    holding the plan itself and the layouts that use the split axes apart (e.g. batch over x*y,
    heads over z where the coarse plan splits heads over y*z)."""
    def fine(spec):
        return tuple(tuple(f for a in dim for f in axes[a]) for dim in spec)

    made = list(zip(graph.inputs, plan.input_specs))
    made += [(graph.ops[op].outputs[k], spec) for op, k, spec in plan.op_specs]
    read = [(graph.ops[op].inputs[pos], spec) for op, pos, spec in plan.operand_specs]  # where read resharded
    out: dict[int, frozenset] = {}
    near: dict = {}  # spec -> its neighbourhood (repeated layers repeat their specs)
    for t, spec in made + read:
        if isinstance(t, int):
            found = near.get(spec)
            if found is None:
                found = near[spec] = _one_axis_away(fine(spec), mesh)
            out[t] = out[t] | found if t in out else found
    return out


def _one_axis_away(spec, mesh: MeshSpec) -> frozenset:
    near = {spec}
    for a in active_axes(mesh):
        without = tuple(tuple(x for x in dim if x != a) for dim in spec)
        near.add(without)
        for d in range(len(spec)):
            near.add(tuple(tuple(sorted(dim + (a,))) if k == d else dim for k, dim in enumerate(without)))
    return frozenset(near)


def keeps_together(plan: Plan, pair: tuple[int, int]) -> bool:
    """Whether every spec of `plan` uses the two neighbouring mesh axes `pair` as one: both in one
    dim, the first right before the second, or neither (the plan is then a plan of the mesh with
    those axes merged)."""
    a, b = pair
    specs = list(plan.input_specs) + [spec for _, _, spec in plan.op_specs]
    for spec in specs:
        for dim in spec:
            if (a in dim) != (b in dim) or (a in dim and dim.index(b) != dim.index(a) + 1):
                return False
    return True


def inter_host_axes(shape: Sequence[int], devices_per_host: int) -> tuple[int, ...]:
    """Mesh axes whose device groups span more than one host, for devices numbered host-major
    (host h owns devices h*D ... h*D+D-1) and laid out row-major on the mesh, as `jax.make_mesh`
    does for a uniform cluster."""
    size = math.prod(shape)
    cluster = Cluster(max(1, size // devices_per_host), min(size, devices_per_host))
    return cluster.inter_host_axes(MeshSpec(tuple(shape), default_axis_names(len(shape))))


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


def step_time_lower_bound(problem: Problem) -> float:
    """Seconds per step no plan of `problem` goes below: per node, its cheapest strategy's cost less
    the part of its collectives that may hide behind compute (`Node.async_s`), summed.

    Sound for `objective.step_time`, the number the plan reports: its total is the nodes' costs
    (compute + own collectives), plus combined latencies and edge resharding (both >= 0), less the
    hidden part, which is at most the nodes' hideable collectives plus the prefetched edges'
    resharding plus the host-offload copies in, each hidden at most whole (`objective.hidden_time`).
    Cheap: one pass over the built ILP, no solver."""
    return float(sum(min((c - a for c, a in zip(n.costs, n.async_s)), default=0.0) for n in problem.nodes))


@dataclasses.dataclass(slots=True)
class _Candidate:
    """A mesh of the search with its ILP and bounds, before it is solved."""

    index: int
    mesh: MeshSpec
    inter: tuple[int, ...]
    options: PlanOptions
    problem: Problem | None = None
    memory_bound: int | None = None
    time_bound: float = 0.0
    build_s: float = 0.0
    refines: tuple | None = None  # (coarse MeshResult, fine axes of each coarse axis): a neighbourhood search


def search_meshes(graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                  devices_per_host: int | None = None, devices: Sequence[Any] | None = None,
                  prune: bool = True, threads: int | None = None,
                  min_peak_search: bool = True, beat: float = math.inf) -> tuple[MeshResult, ...]:
    """Plans `graph` on every mesh; returns the results, planned ones fastest first, failures last.

    Without host offload, when the arguments and outputs alone (`solver.memory_floor`) exceed
    `options.memory_budget` on the devices, only the first mesh's ILP is built (for the smallest
    peak below); the others are over budget without one. The same once the first mesh of a device
    count is built, when the values live at the step's fullest point split over every device
    (`solver.liveness_floor`) exceed it. Each mesh's ILP is built first and
    bounded before any solver runs: a mesh whose memory lower
    bound (`solver.memory_lower_bound`; with host offload, the bound of every offload choice)
    exceeds `options.memory_budget` is not solved (an `InfeasiblePlanError` with that bound); the
    others are solved in order of their step-time lower bound (`step_time_lower_bound`, the likely
    best first), and with `prune` a mesh whose bound is not below the fastest plan found so far is
    not solved (`MeshResult.pruned`): it cannot be faster, so the fastest plan is the one planning
    every mesh would give. When no mesh gives a
    plan and some are over budget, the smallest peak is searched on the most promising of them only
    (the least lower bound; `solver.smallest_peak`, at most `MIN_MEMORY_LIMIT` deterministic units)
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
    budget = options.memory_budget
    planned: list[MeshResult] = []
    failed: list[MeshResult] = []
    pruned: list[MeshResult] = []
    twins: list[tuple[MeshSpec, tuple[int, ...], tuple]] = []
    keys: dict[tuple, MeshSpec] = {}
    built: dict[MeshSpec, _Candidate] = {}
    candidates: list[_Candidate] = []
    deferred: list[_Candidate] = []  # meshes of three or more axes (`refine`)
    floors: dict[int, tuple[int, str]] = {}  # devices -> (bytes no plan goes below, what they are)
    lived: set[int] = set()  # device counts whose `liveness_floor` is known (one built mesh gives it)
    # The probes (`_probe`) run beside the builds of the next meshes: CP-SAT leaves the GIL to them.
    probing = prune and budget is not None and options.offload == "off"
    probe_pool = concurrent.futures.ThreadPoolExecutor(
        max(1, threads or idle_cores() // max(1, options.solver_workers))) if probing else None
    probes: list[tuple[_Candidate, concurrent.futures.Future]] = []
    for k, spec in enumerate(meshes):
        inter = inter_host_axes(spec.shape, devices_per_host) if devices_per_host else options.inter_host_axes
        key = mirror_key(spec, inter) if options.profile is None else None
        if key is not None and key in keys:
            log.info("mesh %s: the problem of mesh %s with its axes permuted; not planned again", spec, keys[key])
            twins.append((spec, inter, key))
            continue
        if key is not None:
            keys[key] = spec
        floor, floor_words = floors.get(spec.size, (None, ""))
        if floor is None and budget is not None and options.offload == "off":
            floor, floor_words = floors[spec.size] = (memory_floor(graph, spec.size,
                                                                   donated_inputs(graph, options.donate_argnums)),
                                                      "its arguments and outputs split over every device")
            log.info("every plan on %d devices needs >= %s/device (arguments and outputs)", spec.size,
                     format_bytes(floor))
        elif floor is not None and floor > budget:  # no ILP to build; the first mesh of each size is still
            # built (above), so that the answer can give the smallest peak of a plan found
            error = InfeasiblePlanError(
                f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {spec}: no plan can go "
                f"below {format_bytes(floor)} ({floor_words}; not solved)",
                None, floor, levers=tuple(dataclasses.replace(v, state="tried") if v.name == "donating the train state"
                                          and donated_inputs(graph, options.donate_argnums) else v for v in LEVERS))
            failed.append(MeshResult(spec, None, error, inter, 0.0, over_bound=True))
            log.info("mesh %s: needs >= %s/device, over the budget: not built", spec, format_bytes(floor))
            continue
        cand = _Candidate(k, spec, inter, dataclasses.replace(options, inter_host_axes=inter))
        if len(spec.shape) >= 3:  # searched around the best plan of a mesh it refines, once that is known
            deferred.append(cand)
            continue
        log.info("building the ILP of mesh %s (%d/%d) ...", spec, k + 1, len(meshes))
        t0 = time.perf_counter()
        try:
            jax_mesh = spec.to_jax_mesh(devices) if devices is not None else None
            cand.problem = plan_problem(graph, spec, cand.options, jax_mesh)
        except (MeshError, PlannerError) as e:
            failed.append(MeshResult(spec, None, e, inter, time.perf_counter() - t0))
            log.info("mesh %s: %s", spec, e)
            continue
        cand.time_bound = step_time_lower_bound(cand.problem)
        if budget is not None and options.offload == "off" and floor is not None and spec.size not in lived:
            lived.add(spec.size)
            live = liveness_floor(cand.problem)  # bounds the later meshes of this size before they are built
            if live > floor:
                floors[spec.size] = (live, "the values live at the step's fullest point split over every device")
                log.info("every plan on %d devices needs >= %s/device (the values live at the fullest point)",
                         spec.size, format_bytes(live))
        if budget is not None:  # with host offload: the bound of every offload choice (`offload.bounding_problem`)
            bounding = bounding_problem(cand.problem, options.offload)
            cand.memory_bound = int(memory_lower_bound(bounding).max())
        cand.build_s = time.perf_counter() - t0
        built[spec] = cand
        if cand.memory_bound is not None and cand.memory_bound > budget:
            error = InfeasiblePlanError(
                f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {spec}: no plan can go "
                f"below {format_bytes(cand.memory_bound)} (lower bound; not solved)", None, cand.memory_bound)
            error.levers = levers_of(bounding)  # the levers the bound counted (`search.no_fit_error` lists them)
            failed.append(MeshResult(spec, None, error, inter, cand.build_s, time_bound_s=cand.time_bound,
                                     over_bound=True))
            log.info("mesh %s: needs >= %s/device, over the budget: not solved", spec, format_bytes(cand.memory_bound))
            continue
        candidates.append(cand)
        if probe_pool is not None and len(spec.shape) >= 2 and over_budget_strategies(cand.problem, budget):
            probes.append((cand, probe_pool.submit(probe_bound, cand.problem, budget, PROBE_UNITS,
                                                   options.solver_workers)))
    threads = max(1, min(len(candidates), idle_cores() // max(1, options.solver_workers) if threads is None
                         else threads))
    probed = _probe(probes, probe_pool) if probe_pool is not None else frozenset()
    candidates.sort(key=lambda c: (c.time_bound, c.index))

    def solve_one(cand: _Candidate, start: tuple[int, ...] | None = None) -> MeshResult:
        log.info("planning mesh %s (step time >= %.4g s%s) ...", cand.mesh, cand.time_bound,
                 "" if start is None else
                 f", a coarser mesh's plan offered as its start, {cand.options.solver_time_limit:.3g} units")
        t0 = time.perf_counter()
        jax_mesh = cand.mesh.to_jax_mesh(devices) if devices is not None else None
        try:
            plan = make_plan(graph, cand.mesh, cand.options, jax_mesh, problem=cand.problem, min_peak_search=False,
                             start=start, beat=(lambda: best) if prune else None)
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
        spent = plan.solver.get("deterministic_time")
        log.info("mesh %s: %.4g s/step, %s/device, planned in %.1fs (%s deterministic units)", cand.mesh,
                 plan.prediction.step_time_s, format_bytes(plan.prediction.memory_bytes_per_device),
                 time.perf_counter() - t0, spent)
        return MeshResult(cand.mesh, plan, None, cand.inter, cand.build_s + time.perf_counter() - t0,
                          time_bound_s=cand.time_bound, deterministic_time=spent)

    # Meshes are solved by `threads` workers (CP-SAT releases the GIL while it searches, so threads
    # run solves side by side), in phases of one axis count, fewest first; within a phase each is
    # dispatched in bound order and pruned against the best plan finished by then. A plan does not
    # depend on the order or on the other solves (one CP-SAT worker, deterministic limits), so the
    # fastest plan is the serial search's.
    #
    # A mesh of two or more axes starts from the fastest plan of a mesh it refines (`coarsenings`:
    # that plan is one of its plans, `refined_choice`) when that start ranks before the solver's own
    # greedy one (`ilp.solver.solve`: it fits the budget and the greedy does not, or it is faster):
    # under a binding budget a 2-D mesh begins from a fitting plan instead of none. Meshes of three
    # or more axes are searched after the others, only those refining the mesh of the fastest plan so
    # far, and only near that plan (`refine`: an ILP over its specs and those one axis away, built
    # then, solved from the plan within `REFINE_UNITS`); a result that is that plan again (no faster,
    # or the split axes kept together everywhere) is reported as such, not as a new plan. From
    # scratch, gpt2-small's whole 2x2x2 ILP took 4.3 s to build and spent the 30-unit limit, 2.8%
    # slower than the 2x4 plan it contains; near the 2x4 plan it builds in 1.9 s and is solved in
    # 0.5 units (its answer: the 2x4 plan).
    best = beat

    def start_of(cand: _Candidate) -> tuple[int, ...] | None:
        if cand.refines is not None:  # searched near that plan (`refine`): it starts there, within REFINE_UNITS
            coarse, axes = cand.refines
            start = refined_choice(cand.problem, coarse.plan, axes)
            if start is not None:
                cand.options = dataclasses.replace(cand.options,
                                                   solver_time_limit=min(options.solver_time_limit, REFINE_UNITS))
            return start
        start, coarse_time = None, math.inf
        by_shape = {r.mesh.shape: r for r in planned}
        for coarse, axes in coarsenings(cand.mesh.shape):
            r = by_shape.get(coarse)
            if r is None or r.plan.prediction.step_time_s >= coarse_time:
                continue
            choice = refined_choice(cand.problem, r.plan, axes)
            if choice is not None:
                start, coarse_time = choice, r.plan.prediction.step_time_s
        return start

    def refine(cand: _Candidate) -> bool:
        """Builds the ILP of a mesh of three or more axes over the neighbourhood (`neighbourhood`) of
        the fastest plan of a mesh it refines; False (and the mesh's result recorded) when there is
        none or the mesh cannot be searched."""
        fastest = min(planned, key=lambda r: r.plan.prediction.step_time_s, default=None)
        around = next(((fastest, axes) for coarse, axes in coarsenings(cand.mesh.shape)
                       if fastest is not None and coarse == fastest.mesh.shape), None)
        if around is None:
            reason = ("no plan of fewer axes to search near" if fastest is None else
                      f"3-D meshes are searched near the fastest plan so far (mesh {fastest.mesh}); this one does "
                      "not refine its mesh")
            pruned.append(MeshResult(cand.mesh, None, None, cand.inter, 0.0, pruned=reason))
            log.info("mesh %s: %s", cand.mesh, reason)
            return False
        log.info("building the ILP of mesh %s around the plan of mesh %s ...", cand.mesh, around[0].mesh)
        t0 = time.perf_counter()
        try:
            jax_mesh = cand.mesh.to_jax_mesh(devices) if devices is not None else None
            cand.problem = plan_problem(graph, cand.mesh, cand.options, jax_mesh,
                                        allowed=neighbourhood(graph, around[0].plan, around[1], cand.mesh))
        except (MeshError, PlannerError) as e:
            failed.append(MeshResult(cand.mesh, None, e, cand.inter, time.perf_counter() - t0))
            log.info("mesh %s: %s", cand.mesh, e)
            return False
        cand.refines = around
        cand.time_bound = step_time_lower_bound(cand.problem)
        cand.build_s = time.perf_counter() - t0
        built[cand.mesh] = cand
        if budget is not None:
            bound = int(memory_lower_bound(bounding_problem(cand.problem, options.offload)).max())
            if bound > budget:  # the neighbourhood holds the coarse plan: only when that is over budget too
                error = InfeasiblePlanError(
                    f"no plan fits the memory budget of {format_bytes(budget)} per device on mesh {cand.mesh} near the "
                    f"plan of mesh {around[0].mesh}: none goes below {format_bytes(bound)} (lower bound; not solved)",
                    None, bound)
                failed.append(MeshResult(cand.mesh, None, error, cand.inter, cand.build_s,
                                         time_bound_s=cand.time_bound, over_bound=True))
                return False
        return True

    def same_as_coarse(cand: _Candidate, result: MeshResult) -> MeshResult:
        """`result`, or a pruned record when its plan is its coarse plan again: no faster, or every
        spec keeping the split axes together (a plan of the coarse mesh)."""
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

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for ndim in sorted({len(c.mesh.shape) for c in candidates + deferred}):
            if ndim >= 3:
                candidates.extend(c for c in deferred if len(c.mesh.shape) == ndim and refine(c))
            queue = sorted((c for c in candidates if len(c.mesh.shape) == ndim), key=lambda c: (c.time_bound, c.index))
            running: dict = {}
            # After a probe the phase's best-bound mesh runs alone until it is done: under a binding
            # budget its plan is usually the fastest by far and prunes the rest (GPT-39B: run beside
            # it, 16x4 spent 26 units before its bound passed 8x8's plan, and 8x8 took 36 s, not 31).
            alone = ndim in probed
            while queue or running:
                while queue and len(running) < (1 if alone else threads):
                    cand = queue.pop(0)
                    if prune and cand.time_bound >= best:
                        reason = (f"not solved: its step-time lower bound {cand.time_bound:.4g} s is not below the "
                                  f"{best:.4g} s of a plan found")
                        pruned.append(MeshResult(cand.mesh, None, None, cand.inter, cand.build_s, pruned=reason,
                                                 time_bound_s=cand.time_bound))
                        log.info("mesh %s: %s", cand.mesh, reason)
                        continue
                    running[pool.submit(solve_one, cand, start_of(cand) if ndim > 1 else None)] = cand
                if not running:
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    alone = False
                    result = same_as_coarse(running.pop(future), future.result())
                    if result.pruned is not None:
                        pruned.append(result)
                    elif result.plan is not None:
                        planned.append(result)
                        best = min(best, result.plan.prediction.step_time_s)
                    else:
                        failed.append(result)
    if not planned and min_peak_search:
        _search_smallest_peak(failed, built, options)
    by_mesh = {r.mesh: r for r in planned + failed + pruned}
    mirrors = []
    for spec, inter, key in twins:
        twin = by_mesh.get(keys[key])
        if twin is None:
            continue
        if twin.plan is not None:
            mirrors.append(MeshResult(spec, None, None, inter, 0.0, same_as=twin.mesh))
        elif twin.pruned is not None:
            pruned.append(MeshResult(spec, None, None, inter, 0.0, same_as=twin.mesh, pruned=twin.pruned,
                                     time_bound_s=twin.time_bound_s))
        else:
            failed.append(MeshResult(spec, None, twin.error, inter, 0.0, same_as=twin.mesh))
    order = {spec: k for k, spec in enumerate(meshes)}
    planned.sort(key=lambda r: (r.plan.prediction.step_time_s, order[r.mesh]))
    pruned.sort(key=lambda r: order[r.mesh])
    failed.sort(key=lambda r: (not r.over_budget, r.min_memory_bytes or r.lower_bound_bytes or 0, order[r.mesh]))
    return tuple(planned + mirrors + pruned + failed)


def _probe(probes: list[tuple[_Candidate, concurrent.futures.Future]],
           pool: concurrent.futures.ThreadPoolExecutor) -> frozenset[int]:
    """Raises the step-time bound of each mesh of two or more axes whose memory budget binds (the
    memory lower bound rules strategies out) to `solver.probe_bound`'s, when there are several such
    meshes to order: the search then solves them best bound first and prunes those whose bound is not
    below a plan found (GPT-39B on 8x8 V100 16 GB: 8x8 first, the four other 2-D meshes not solved;
    before, the per-op bounds were equal within 0.5% and the search spent 30 units on each of 32x2
    and 16x4 first). `probes`: those meshes with their probes, started as each mesh was built
    (`search_meshes`), so that they ran beside the later builds. Returns the axis counts of the
    meshes probed."""
    pool.shutdown(wait=True)
    if len(probes) < 2:
        return frozenset()
    for cand, future in probes:
        bound = future.result()
        log.info("mesh %s: step time >= %.4g s under the budget (%.3g-unit probe; %.4g s without it)",
                 cand.mesh, bound, PROBE_UNITS, cand.time_bound)
        cand.time_bound = max(cand.time_bound, bound)
    return frozenset(len(c.mesh.shape) for c, _ in probes)


def _search_smallest_peak(failed: list[MeshResult], built: dict[MeshSpec, _Candidate], options: PlanOptions) -> None:
    """No mesh gave a plan: the minimum-peak search on the one over-budget mesh with the least memory
    lower bound (among those whose ILP was built), its result put into that mesh's error."""
    over = [(r.lower_bound_bytes if r.lower_bound_bytes is not None else math.inf, built[r.mesh].index, k)
            for k, r in enumerate(failed) if r.over_budget and r.mesh in built]
    if not over:
        return
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


def idle_cores() -> int:
    """The idle cores this process may run on: its cores less the load the rest of the machine puts
    on them, at least one. Solves on busy cores would only share them, and reach CP-SAT's
    wall-clock cap sooner (a plan stopped by it depends on the load, `solver.WALL_CAP_FACTOR`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        load = 0.0
    return spare_cores(cores, load)


def spare_cores(cores: int, load: float) -> int:
    """`cores` less the 1-minute `load` average that is not this process's own: the caller runs on
    one core while it asks (tracing, building the problems), and that thread is part of the load
    average, so up to one unit of it is ours (measured before this: an idle 2-core machine, load 1.0
    from the planner itself, solved its independent problems one at a time)."""
    others = max(0.0, load - 1.0)
    return max(1, min(cores, int(cores - others + 0.5)))


def mirror_key(spec: MeshSpec, inter: Sequence[int]) -> tuple:
    """Meshes with equal keys are one planning problem: the same axis sizes on the same links, in
    another order (2x4 and 4x2 inside one host). The cost model sees an axis only through its size
    and its link (inter-host or not), and strategies range over every assignment of axes to
    dims, so a permutation of the axes permutes the plans and leaves every predicted number as it is
    (a profile measures each axis group separately, so `search_meshes` does not use this then)."""
    return tuple(sorted((size, axis in inter) for axis, size in enumerate(spec.shape)))


def no_fit_error(results: Sequence[MeshResult], budget: float | None = None,
                 levers: Sequence[Lever] = LEVERS) -> InfeasiblePlanError:
    """The one-line answer when no mesh of a `search_meshes` result gives a plan and some are over
    the memory budget: the least proven lower bound over the mesh shapes, the smallest peak found
    (and where), which meshes were not solved because their bound alone is over the budget, which
    the solver could not decide within its limit, and the levers (`solver.LEVERS`)."""
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
    text += f". {levers_text(levers)}. Raise the memory budget (memory_budget, --memory-budget) or use more devices"
    return InfeasiblePlanError(text, min(found)[0] if found else None, min(floors)[0] if floors else None)


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
