"""What `plan_pipeline` searches: microbatch counts, submeshes and their logical meshes; and the
layer cost table and DP of one microbatch count over them.

Alpa's space: the submesh shapes that always tile the cluster (`submesh.submesh_shapes`), each
viewed as one or more logical meshes (`submesh.logical_meshes`), and every microbatch count the
batch divides into (`microbatches.microbatch_counts`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.configs.baselines import layer_variant_pins
from planner.core.options import PlanOptions
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.graph.shape_family import MIN_SIZE, ShapeFamily, same_program
from planner.stages.candidate import once_per_step_max, stage_option
from planner.stages.clustering import Layers
from planner.stages.cost_table import LAYER_PROBLEMS, LayerCostTable
from planner.stages.dp import DPResult, pipeline_dp
from planner.stages.microbatches import MicrobatchGraphs, PlanningMemo, batch_size, microbatch_counts
from planner.stages.stage_cost import LAYOUTS, StageTimes, stage_times
from planner.stages.submesh import LogicalMesh, logical_meshes, submesh_shapes

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """`plan_pipeline`'s arguments and what follows from them, fixed for the whole search.

    Attributes:
      t_start: when planning began.
      batch: the batch size; counts: the microbatch counts tried.
      min_stages: 2 when a pipeline is required (`pipeline=True`), else 1.
      budget: the memory budget per device.
      shapes: the submesh shapes, the whole cluster last; sizes: their device counts.
      meshes: every logical mesh of every submesh; per_submesh: each submesh's indices into `meshes`.
      cache: the layer plans of every count's table (shared: identical layers are planned once).
      graphs: the step's graph per microbatch size (one trace for all sizes where it can).
      variant_pins: the hand layouts' pins by (layout, microbatch rows, mesh, host axes) (`PlanningMemo.pins`).
      ranges: the stage ways' layer-range costs (`PlanningMemo.ranges`, `stage_cost.stage_ranges`).
      dp_memo: the pipeline DP's evaluations per stage latency table (`PlanningMemo.dp`).
      single_floors: the single stage's memory floors at the batch sizes planned (`PlanningMemo.single_floors`).
      timings: seconds spent per planning phase, accumulated.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    cluster: Cluster
    options: PlanOptions
    batch_argnum: int | tuple[int, ...]
    rel_gap: float
    num_layers: int | None
    pins: Callable[[Graph, LogicalMesh], Mapping[int, Any]] | None
    devices: Sequence[Any]
    layer_variants: Sequence[str]
    t_start: float
    batch: int
    counts: tuple[int, ...]
    min_stages: int
    budget: float
    shapes: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    meshes: tuple[LogicalMesh, ...]
    per_submesh: tuple[tuple[int, ...], ...]
    cache: dict
    timings: dict[str, float]
    graphs: MicrobatchGraphs
    variant_pins: dict
    ranges: dict
    dp_memo: dict
    single_floors: dict

    @property
    def hand_layouts(self) -> bool:
        """Whether layers are also planned in the hand layouts (`layer_variants`; pins fix the layout)."""
        return bool(self.layer_variants) and self.pins is None


def search_space(fn: Callable[..., Any], args: tuple[Any, ...], cluster: Cluster, options: PlanOptions, *,
                 batch_argnum: int | tuple[int, ...], max_mesh_ndim: int, microbatch_limit: int | None,
                 rel_gap: float, num_layers: int | None, full_graph: Graph | None,
                 pins: Callable[[Graph, LogicalMesh], Mapping[int, Any]] | None, devices: Sequence[Any],
                 layer_variants: Sequence[str], memo: PlanningMemo | None = None) -> SearchSpace:
    """The space `plan_pipeline` searches for these arguments (see its Args); with a `memo`, its
    symbolic trace and layer plans are the memo's."""
    memo = memo if memo is not None else PlanningMemo()
    batch = batch_size(args, batch_argnum)
    family, traced = memo.family, memo.traced
    if memo.step is not fn:  # a memo filled for another step function (a factory's step per batch size)
        if isinstance(family, ShapeFamily) and full_graph is not None and batch >= MIN_SIZE \
                and same_program(family.at(batch), full_graph):
            traced = dict(traced)  # every size's graph the family's (one row too: `ShapeFamily.program_at`)
        else:
            if isinstance(family, ShapeFamily):
                log.info("the step at batch %d is not the one traced for an earlier batch size: traced again", batch)
            family, traced = None, {}
        memo.pins.clear()  # pins, stage plans and range costs: shared between calls of one step function only
        memo.stage_plans.clear()
        memo.ranges.clear()
        memo.dp.clear()
        memo.stage_traces.clear()
        memo.stage_solved.clear()
        memo.single_floors.clear()
    t_start = time.perf_counter()
    counts = microbatch_counts(batch, options.num_microbatches, microbatch_limit)
    shapes = submesh_shapes(cluster.hosts, cluster.devices_per_host)
    meshes: list[LogicalMesh] = []
    per_submesh: list[tuple[int, ...]] = []
    for shape in shapes:
        idx = []
        for lm in logical_meshes(shape, cluster, max_mesh_ndim):
            idx.append(len(meshes))
            meshes.append(lm)
        per_submesh.append(tuple(idx))
    if memo.keep_layer_problems:
        memo.layer_plans.setdefault(LAYER_PROBLEMS, {})
    return SearchSpace(
        fn=fn, args=args, cluster=cluster, options=options, batch_argnum=batch_argnum, rel_gap=rel_gap,
        num_layers=num_layers, pins=pins, devices=devices, layer_variants=layer_variants,
        t_start=t_start, batch=batch, counts=counts, min_stages=2 if options.pipeline is True else 1,
        budget=options.memory_budget or cluster.hardware.memory_bytes, shapes=shapes,
        sizes=tuple(n * m for n, m in shapes), meshes=tuple(meshes), per_submesh=tuple(per_submesh),
        cache=memo.layer_plans, timings={"trace_s": 0.0, "layer_costs_s": 0.0, "dp_s": 0.0},
        graphs=MicrobatchGraphs(fn, args, batch_argnum, full_graph, family, traced),
        variant_pins=memo.pins, ranges=memo.ranges, dp_memo=memo.dp, single_floors=memo.single_floors)


def layer_table(space: SearchSpace, B: int) -> tuple[Graph, Layers, LayerCostTable, float]:
    """The step traced at `B` microbatches, its layers, their cost table on every logical mesh (not
    filled yet) and when the table was made (its filling is timed from there).

    Raises:
      UntraceableMicrobatches: the step does not trace on microbatches of that size.
    """
    t0 = time.perf_counter()
    graph = space.graphs.at(B, space.batch // B)
    layers = space.graphs.layers_at(B, space.batch // B, space.num_layers)
    space.timings["trace_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    pins = space.pins
    # The hand layouts as per-layer plan variants (`cost_table.LAYER_VARIANTS`), unless pins fix the layout.
    variants = {} if pins is not None else {
        name: (lambda m, g=graph, f=layer_variant_pins(name), n=name, r=space.batch // B:
               _memo_pins(space.variant_pins, (n, r, m.mesh, m.host_axes), lambda: f(g, m)))
        for name in space.layer_variants}
    table = LayerCostTable(graph, layers, space.meshes, space.cluster, space.options, space.cache,
                           pins=None if pins is None else (lambda m, g=graph: pins(g, m)), variants=variants,
                           ranges=space.ranges, microbatches=B)
    return graph, layers, table, t0


def _memo_pins(memo: dict, key: tuple, make: Callable[[], Any]) -> Any:
    """A hand layout's pins on a logical mesh at a microbatch size, made once per planning memo
    (each table asks on every mesh; 2k parameter leaves take ~0.05 s each time)."""
    if key not in memo:
        memo[key] = make()
    return memo[key]


def price(space: SearchSpace, B: int, table: LayerCostTable, boundary: np.ndarray, variants: Sequence[str]
          ) -> tuple[StageTimes, DPResult | None, float]:
    """The stage latency table of `B` microbatches in the per-layer plans `variants`, the DP's
    pipeline over it (None: none fits) and its step time (the pipeline latency plus the largest
    per-stage once-per-step term).

    The DP minimises the pipeline latency; the once-per-step term is added after it. An
    offloaded-optimizer stage trades time per microbatch for a trip over the host link once per
    step, so where the DP's pipeline has one, the pipeline without that layout is priced too and
    the faster step kept (Llama-70B b128 s4096 on 8x8 H100 at 128 microbatches: 13.383 s of latency
    with two offloaded stages, but 13.693 s per step, against 13.518 without). Without an offloaded
    stage in it the DP's pipeline is the one it would find without the layout."""
    st, dp, step = _priced(space, B, table, boundary, variants, LAYOUTS)
    chosen = [] if dp is None else [stage_option(st, s, len(dp.stages) - k) for k, s in enumerate(dp.stages)]
    if any(o.layout == "offloaded-optimizer" for o in chosen):
        kept = _priced(space, B, table, boundary, variants, tuple(x for x in LAYOUTS if x != "offloaded-optimizer"))
        if kept[2] < step:
            return kept
    return st, dp, step


def _priced(space: SearchSpace, B: int, table: LayerCostTable, boundary: np.ndarray, variants: Sequence[str],
            layouts: Sequence[str]) -> tuple[StageTimes, DPResult | None, float]:
    t0 = time.perf_counter()
    st = stage_times(table, space.shapes, space.per_submesh, B, space.options.schedule, space.budget, boundary,
                     layouts=layouts, variants=variants)
    space.timings["layer_costs_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    dp = pipeline_dp(st.times, space.sizes, space.cluster.num_devices, B, min_stages=space.min_stages,
                     rel_gap=space.rel_gap, memo=space.dp_memo)
    space.timings["dp_s"] += time.perf_counter() - t0
    step = math.inf if dp is None else dp.objective_s + once_per_step_max(table, st, dp.stages)
    return st, dp, step


def ignoring_memory(space: SearchSpace, B: int, table: LayerCostTable, boundary: np.ndarray
                    ) -> tuple[StageTimes, DPResult | None]:
    """The stage latency table of `B` microbatches in the layers' own plans with no memory limit, and
    the DP's pipeline over it."""
    t0 = time.perf_counter()
    free = stage_times(table, space.shapes, space.per_submesh, B, space.options.schedule, math.inf, boundary,
                       variants=("",))
    bound = pipeline_dp(free.times, space.sizes, space.cluster.num_devices, B, min_stages=space.min_stages,
                        rel_gap=space.rel_gap, memo=space.dp_memo)
    space.timings["dp_s"] += time.perf_counter() - t0
    return free, bound
