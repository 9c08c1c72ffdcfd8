"""The single-stage levers composed over a mesh search: gradient accumulation (k microbatches in the
step), or recomputation and host offload around `search_meshes`; `planner plan` ranks what this
returns and `planner compare` prices its best plan beside the hand configurations."""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from planner.core.errors import InfeasiblePlanError, PlannerError
from planner.core.mesh import MeshSpec, default_axis_names
from planner.core.options import PlanOptions
from planner.core.units import format_bytes
from planner.graph.ir import Graph
from planner.ilp.offload import streamed
from planner.levers.accumulate import micro_options, plan_accumulation
from planner.levers.remat import plan_remat, record as remat_record
from planner.search.meshes import search_meshes
from planner.search.results import MeshResult, no_fit_error

log = logging.getLogger("planner")


def plan_single_stage(step: Callable[..., Any], graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                      per_host: int | None, budget: float | None) -> tuple[Graph, Sequence[MeshResult]]:
    """(the graph planned, one result per mesh) of `step` traced as `graph`, planned on `meshes` with
    the levers `options` asks for: `accumulate` > 1 or "auto" plans k microbatches (`accumulated`),
    else every mesh is searched with `remat` and `offload` (`searched`).

    Raises:
      InfeasiblePlanError: no mesh gives a plan within `budget` (the one-line answer of `no_plan`).
    """
    if options.accumulate not in (None, 1):
        return accumulated(step, graph, meshes, options, per_host, budget)
    return searched(graph, meshes, options, per_host, budget)


def searched(graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions, per_host: int | None,
             budget: float | None) -> tuple[Graph, list[MeshResult]]:
    """Every mesh planned (`search_meshes`) on the graph with recomputation (`levers.remat`,
    `options.remat`) and, with `options.offload`, a streamed optimizer update (`ilp.offload.streamed`)."""

    def search(g: Graph, smallest_peak: bool) -> list[MeshResult]:
        if options.offload != "off":
            g = streamed(g)
        found = search_meshes(g, meshes, options, per_host, min_peak_search=smallest_peak)
        if found[0].plan is None:
            raise no_plan(found, budget)
        return found

    planned, results, policy, without = plan_remat(graph, options.remat, budget, search,
                                                   lambda found: found[0].plan)
    if options.remat != "off":
        results = [dataclasses.replace(r, plan=remat_record(r.plan, graph, planned, policy, without)) if r.plan
                   else r for r in results]
    if options.offload != "off":
        planned = streamed(planned)
    return planned, results


def accumulated(step: Callable[..., Any], graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                per_host: int | None, budget: float | None) -> tuple[Graph, tuple[MeshResult]]:
    """The microbatch step planned on every mesh (`search_meshes`), k chosen by
    `levers.accumulate.plan_accumulation`; the best plan as the one result, with the microbatch graph."""
    seen: list = []

    def plan_micro(g: Graph, inner: float | None):
        results = search_meshes(g, meshes, micro_options(options, inner), per_host)
        seen.append(results)
        if results[0].plan is None:
            raise no_plan(results, inner, accumulated=True)
        return results[0].plan

    bounds = MeshSpec((meshes[0].size,), default_axis_names(1))
    t0 = time.perf_counter()
    acc = plan_accumulation(step, graph, options.accumulate, budget, plan_micro, bounds, options.unshard)
    plan = dataclasses.replace(acc.plan, options=dataclasses.replace(acc.plan.options, accumulate=options.accumulate))
    record = plan.levers.accumulation
    log.info("gradient accumulation: %d microbatch(es) of %d rows", record.microbatches, record.microbatch_rows)
    inter = next((r.inter_host_axes for rs in seen for r in rs if r.plan is not None and r.mesh == plan.mesh), ())
    return acc.graph, (MeshResult(plan.mesh, plan, None, inter, time.perf_counter() - t0),)


def no_plan(results: Sequence[MeshResult], budget: float | None, accumulated: bool = False) -> PlannerError:
    """The error of a search where no mesh shape gave a plan: what did not fit, and what to try
    (with accumulation: the smallest peak found and the least lower bound as its facts too)."""
    over = [r for r in results if r.over_budget]
    if not over:
        return PlannerError("no mesh shape could be planned: " + "; ".join(f"{r.mesh}: {r.error}" for r in results))
    if not accumulated:
        return no_fit_error(results, budget)
    need = min((r.min_memory_bytes for r in over if r.min_memory_bytes is not None), default=math.inf)
    floor = min((r.error.lower_bound_bytes for r in over if getattr(r.error, "lower_bound_bytes", None) is not None),
                default=math.inf)
    return InfeasiblePlanError(
        f"no mesh shape fits the memory budget of {format_bytes(budget) if budget else 'no limit'} per device"
        + (f" (the smallest reachable peak is {format_bytes(need)}" if need < math.inf else "")
        + (f"; no plan goes below {format_bytes(floor)}" if floor < math.inf else "")
        + (")" if need < math.inf else "")
        + "; tried: sharding, gradient accumulation"
        + "; not available with gradient accumulation yet: rematerialisation, host offload"
        + "; raise --memory-budget, plan for more devices, or enable --pipeline (recompute)",
        None if need == math.inf else need, None if floor == math.inf else floor)
