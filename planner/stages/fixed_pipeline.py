"""Hand-chosen pipelines (the `NAME+ppN` baselines), priced by the planner's own pipeline path.

Megatron-LM's way: `num_stages` even stages of the repeated layers on equal submeshes, each stage's
layers planned in a configuration's pins; the stage tables, pipeline latency and once-per-step terms
are `plan_pipeline`'s, only the stage boundaries and submeshes are fixed instead of searched.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.core.options import PlanOptions
from planner.core.sharding import Spec
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.stages.candidate import Candidate, once_per_step_max, stage_plans, to_pipeline_plan
from planner.stages.clustering import Layers, cluster_layers
from planner.stages.cost_table import LayerCostTable, planned_layers
from planner.stages.dp import DPResult, StageChoice, pipeline_latency
from planner.stages.layer_facts import boundary_bytes
from planner.stages.microbatches import (MicrobatchGraphs, UntraceableMicrobatches, batch_size, microbatch_counts,
                                         none_traces, trace_replica)
from planner.stages.pipeline_plan import PipelinePlan
from planner.stages.selection import cheapest_as_run
from planner.stages.stage_cost import StageTimes, stage_times
from planner.stages.submesh import LogicalMesh, logical_meshes, tensor_parallel_mesh

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class _EvenPipeline:
    """`fixed_pipeline`'s arguments and what follows from them, fixed for every microbatch count.

    Attributes:
      shape: each stage's submesh; lm: the logical mesh it is planned as.
      batch: the batch size; counts: the microbatch counts tried.
      budget: the memory budget per device; remats: the recomputation choices tried.
      cache: the layer plans of every count's table; timings: seconds per planning phase, accumulated.
      graphs: the step's graph per microbatch size (one trace for all sizes where it can).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    cluster: Cluster
    options: PlanOptions
    num_stages: int
    shape: tuple[int, int]
    lm: LogicalMesh
    batch: int
    batch_argnum: int | tuple[int, ...]
    counts: tuple[int, ...]
    budget: float
    remats: tuple[bool, ...]
    pins: Callable[[Graph, LogicalMesh], Mapping[int, Spec]] | None
    replica_ways: Callable[[Graph, LogicalMesh], int] | None
    num_layers: int | None
    t_start: float
    cache: dict
    timings: dict[str, float]
    graphs: MicrobatchGraphs


@dataclasses.dataclass(frozen=True)
class _Priced:
    """The microbatch counts priced so far: their candidates, whether each fits memory (by count;
    one that does not is priced ignoring memory) and why each count that does not trace does not."""

    candidates: tuple[Candidate, ...] = ()
    fits: Mapping[int, bool] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    untraceable: tuple[str, ...] = ()


def even_stage_ranges(layers: Layers, num_stages: int) -> tuple[tuple[int, int], ...]:
    """(first, last) layer of each of `num_stages` hand-chosen even stages, as Megatron-LM splits a
    model: the repeated layers (`blocks_i`) evenly, the embedding layer ("pre") with the first stage
    and the head and loss ("post") with the last.

    Raises:
      InvalidArgumentError: the repeated layers do not split evenly into `num_stages` (one line).
    """
    names, L = layers.names, layers.num_layers
    pre = int(layers.method == "modules" and L > 1 and names[0] == "pre")
    post = int(layers.method == "modules" and L > 1 and names[-1] == "post")
    n = L - pre - post
    if num_stages < 1 or n < num_stages or n % num_stages:
        raise InvalidArgumentError(
            f"the {n} layers {names[pre]}..{names[L - 1 - post]} do not split evenly into {num_stages} pipeline "
            f"stages; choose a stage count that divides {n}")
    per = n // num_stages
    return tuple((0 if k == 0 else pre + k * per, L - 1 if k == num_stages - 1 else pre + (k + 1) * per - 1)
                 for k in range(num_stages))


def even_submesh(cluster: Cluster, num_stages: int) -> tuple[int, int]:
    """The submesh of each of `num_stages` equal stages: whole hosts when there are at least as
    many hosts as stages (stages across hosts), else an equal part of every host.

    Raises:
      InvalidArgumentError: the devices do not split into `num_stages` equal submeshes (one line).
    """
    D, M = cluster.num_devices, cluster.devices_per_host
    per = D // num_stages if num_stages >= 1 else 0
    if per and D % num_stages == 0 and per % M == 0:
        return (per // M, M)
    if per and D % num_stages == 0 and M % per == 0:
        return (1, per)
    raise InvalidArgumentError(
        f"{cluster} ({D} devices, {M} per host) does not split into {num_stages} equal pipeline stages of whole "
        f"hosts or equal parts of a host; choose a stage count dividing {cluster.hosts} hosts or {M} devices per host")


def fixed_pipeline(fn: Callable[..., Any], args: tuple[Any, ...], cluster: Cluster, options: PlanOptions,
                   num_stages: int, *, pins: Callable[[Graph, LogicalMesh], Mapping[int, Spec]] | None = None,
                   batch_ways: Callable[[LogicalMesh], int] | None = None,
                   replica_ways: Callable[[Graph, LogicalMesh], int] | None = None, remat: bool | None = None,
                   batch_argnum: int | tuple[int, ...] = -1, max_mesh_ndim: int = 2,
                   num_layers: int | None = None, full_graph: Graph | None = None,
                   tensor_parallel: int | None = None) -> PipelinePlan:
    """A hand-chosen pipeline costed by the planner's own pipeline path (the pp baselines).

    `num_stages` even stages (`even_stage_ranges`), each on an equal submesh (`even_submesh`)
    viewed as the logical mesh the planner would plan it as (`logical_meshes`: hosts x devices
    across hosts, the most square 2-D mesh inside one host), with the program inputs `pins(graph,
    mesh)` fixes pinned in every layer's ILP. Everything else is `plan_pipeline`'s: per-layer cost
    tables (`LayerCostTable`), stage latencies per microbatch with boundary transfers (`stage_times`,
    state layout "plan"), pipeline latency with its bubble (`pipeline_latency`) and the largest
    stage's once-per-step data-parallel gradient sync + update (`once_per_step_max`).

    Args:
      options: `num_microbatches` (None: every count dividing the batch for which `batch_ways`
        divides the microbatch and the step traces on it and on one of its `replica_ways` shares,
        the fastest kept, as the pipeline search picks it), `schedule`,
        `memory_budget` (default: the device memory; it decides recomputation when `remat` is
        None; a configuration that fits nowhere is costed ignoring memory and says so in
        `planning.fits_memory`).
      pins: program input tensor id -> Spec on the stage's logical mesh.
      batch_ways: how many ways the configuration splits the batch dim on that mesh.
      replica_ways: `(microbatch graph, that mesh) ->` how many data-parallel replicas accumulate
        their own gradients there (the pipeline runtime traces the step on each one's share of a
        microbatch, `trace_replica`); None: none do.
      remat: True / False: every stage recomputes (or keeps) its activations; None: the faster
        that fits.
      tensor_parallel: view each stage's submesh as Megatron-LM's (data, tensor) mesh with this
        many devices of one host on the tensor axis (`submesh.tensor_parallel_mesh`) instead of
        the planner's logical mesh.

    Raises:
      InvalidArgumentError: layers or devices that do not split evenly, a microbatch count that
        does not divide the batch or that the configuration cannot split; `UntraceableMicrobatches`
        when the step traces on no count's microbatch or replica's share of one.
    """
    t_start = time.perf_counter()
    shape = even_submesh(cluster, num_stages)
    lm = (logical_meshes(shape, cluster, max_mesh_ndim)[0] if tensor_parallel is None
          else tensor_parallel_mesh(shape, cluster, tensor_parallel))
    batch = batch_size(args, batch_argnum)
    ways = batch_ways(lm) if batch_ways is not None else 1
    even = _EvenPipeline(
        fn=fn, args=args, cluster=cluster, options=options, num_stages=num_stages, shape=shape, lm=lm, batch=batch,
        batch_argnum=batch_argnum, counts=_even_counts(batch, options, ways, lm),
        budget=options.memory_budget or cluster.hardware.memory_bytes,
        remats=(False, True) if remat is None else (bool(remat),), pins=pins, replica_ways=replica_ways,
        num_layers=num_layers, t_start=t_start, cache={},
        timings={"trace_s": 0.0, "layer_costs_s": 0.0}, graphs=MicrobatchGraphs(fn, args, batch_argnum, full_graph))
    priced = _Priced()
    for B in even.counts:
        priced = _with_count(even, priced, B)
    return _chosen(even, priced)


def _even_counts(batch: int, options: PlanOptions, ways: int, lm: LogicalMesh) -> tuple[int, ...]:
    """The microbatch counts whose microbatches the configuration splits `ways` ways.

    Raises:
      InvalidArgumentError: there are none.
    """
    counts = tuple(B for B in microbatch_counts(batch, options.num_microbatches) if (batch // B) % ways == 0)
    if not counts:
        given = options.num_microbatches
        raise InvalidArgumentError(
            (f"num_microbatches={given} gives microbatches of {batch // given}" if given else
             f"no microbatch count of the batch {batch} gives microbatches") +
            f" that this configuration splits {ways} ways on each stage's mesh {lm.mesh}; choose a count B with "
            f"{batch} / B a multiple of {ways}")
    return counts


def _traced(even: _EvenPipeline, B: int) -> Graph:
    """The step traced at `B` microbatches, checked to trace on each data-parallel replica's share.

    Raises:
      UntraceableMicrobatches: it does not.
    """
    rows = even.batch // B
    graph = even.graphs.at(B, rows)
    trace_replica(even.fn, even.args, B, rows, even.replica_ways(graph, even.lm) if even.replica_ways else 1,
                  even.batch_argnum)
    return graph


def _with_count(even: _EvenPipeline, priced: _Priced, B: int) -> _Priced:
    """`priced` with the even pipeline of `B` microbatches (or with why the step does not trace on them)."""
    t0 = time.perf_counter()
    try:
        graph = _traced(even, B)
    except UntraceableMicrobatches as e:
        log.warning("B=%d: %s; not a candidate", B, e)
        return dataclasses.replace(priced, untraceable=priced.untraceable + (str(e),))
    layers = cluster_layers(graph, even.num_layers)
    ranges = even_stage_ranges(layers, even.num_stages)
    even.timings["trace_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    pins = even.pins
    table = LayerCostTable(graph, layers, (even.lm,), even.cluster, even.options, even.cache,
                           pins=None if pins is None else (lambda m, g=graph: pins(g, m)), microbatches=B)
    boundary = boundary_bytes(graph, layers)
    st, chosen = _even_stages(even, table, boundary, ranges, B, even.budget)
    fits = all(math.isfinite(c.time_s) for c in chosen)
    if not fits:
        st, chosen = _even_stages(even, table, boundary, ranges, B, math.inf)
    even.timings["layer_costs_s"] += time.perf_counter() - t0
    dp, step = _even_step(table, st, chosen, B)
    log.info("B=%d: %d even stages, predicted %.4g s/step%s", B, even.num_stages, step,
             "" if fits else " (does not fit)")
    candidate = Candidate(B, graph, layers, table, st, dp, step)
    return dataclasses.replace(priced, candidates=priced.candidates + (candidate,),
                               fits=MappingProxyType({**priced.fits, B: fits}))


def _even_stages(even: _EvenPipeline, table: LayerCostTable, boundary, ranges: tuple[tuple[int, int], ...], B: int,
                 limit: float) -> tuple[StageTimes, tuple[StageChoice, ...]]:
    """The stage table of the even submesh in state layout "plan" under the memory `limit`, and the
    even stages' latencies in it (infinite: a stage that does not fit)."""
    S = even.num_stages
    st = stage_times(table, (even.shape,), ((0,),), B, even.options.schedule, limit, boundary,
                     layouts=("plan",), remats=even.remats, kept=(),  # a hand configuration: all or none
                     offload_acts=False)
    return st, tuple(StageChoice(first, last, 0, float(st.times[min(S - k, len(st.inflight)) - 1, first, last, 0]))
                     for k, (first, last) in enumerate(ranges))


def _even_step(table: LayerCostTable, st: StageTimes, chosen: tuple[StageChoice, ...], B: int
               ) -> tuple[DPResult | None, float]:
    """The even stages as a DP result and their step time (None and infinity: a stage has no plan)."""
    times = [c.time_s for c in chosen]
    if not all(math.isfinite(t) for t in times):
        return None, math.inf
    latency = pipeline_latency(times, B)
    return DPResult(chosen, latency, max(times), 0), latency + once_per_step_max(table, st, chosen)


def _chosen(even: _EvenPipeline, priced: _Priced) -> PipelinePlan:
    """The fastest count, fitting memory first, as run (`selection.cheapest_as_run`), as a `PipelinePlan`.

    Raises:
      UntraceableMicrobatches: no count traces; InfeasiblePlanError: no layer has a plan on the mesh.
    """
    if not priced.candidates and priced.untraceable:
        raise none_traces(priced.untraceable, even.counts)
    feasible = [c for c in priced.candidates if c.dp is not None]
    if not feasible:
        raise InfeasiblePlanError(f"no layer of this configuration can be planned on the stage mesh {even.lm.mesh}")
    fits = priced.fits
    plans, best, per_microbatch = cheapest_as_run(
        even.fn, even.args, feasible, lambda c: (not fits[c.B], c.step_s, -c.B),
        lambda c: stage_plans(c, (even.shape,), (even.lm,), even.cluster), even.batch, even.batch_argnum)
    return to_pipeline_plan(best, plans, even.options, even.cluster, even.t_start, even.timings, planned_layers(even.cache),
                            None, None, tuple((c.B, c.step_s, even.num_stages) for c in priced.candidates),
                            {"dp_evaluations": 0, "logical_meshes": 1, "stages_chosen": "even (hand-chosen)",
                             "fits_memory": fits[best.B],
                             **({"grad_sync_per_microbatch": tuple(per_microbatch)} if per_microbatch else {})})
