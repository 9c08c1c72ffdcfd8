"""A candidate pipeline: one microbatch count priced, and the stage plans and `PipelinePlan` it makes.

A `Candidate` holds what pricing a count gave: the step traced at its microbatch size, its layers,
their cost table, the stage latency table (`StageTimes`) and the stages chosen. Its step time is the
pipeline latency plus the largest per-stage once-per-step term (`once_per_step_max`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from types import MappingProxyType

from planner.core.options import PlanOptions
from planner.core.pipeline_records import PipelinePlanning
from planner.core.sharding import Spec
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.stages.clustering import Layers
from planner.stages.cost_table import LayerCostTable
from planner.stages.dp import DPResult, StageChoice, bubble_fraction, pipeline_latency
from planner.stages.layer_cost import splits_data
from planner.stages.layer_facts import external_inputs
from planner.stages.pipeline_plan import PipelinePlan, StagePlan
from planner.stages.stage_cost import (StageOption, StageTimes, once_per_step_columns, stage_collectives,
                                       stage_communication, stage_memory)
from planner.stages.submesh import LogicalMesh, boundary_link, place_submeshes


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One microbatch count priced.

    Attributes:
      B: the microbatch count.
      graph: the step traced at its microbatch size; layers: its layers.
      table: their cost table; st: the stage latency table the stages were chosen from.
      dp: the stages chosen (None: no pipeline fits).
      step_s: the predicted step time.
    """

    B: int
    graph: Graph
    layers: Layers
    table: LayerCostTable
    st: StageTimes
    dp: DPResult | None
    step_s: float


def stage_option(st: StageTimes, stage: StageChoice, position: int) -> StageOption:
    """The way the stage runs at `position` from the end of the pipeline (its in-flight count)."""
    q = min(position, len(st.inflight)) - 1
    j = int(st.option[q, stage.first, stage.last, stage.submesh])
    return st.options[stage.submesh][j]


def once_per_step(table: LayerCostTable, opt: StageOption, first: int, last: int) -> tuple[float, float]:
    """(data-parallel gradient reduction, optimizer update) of the stage of layers first..last."""
    costs = [table.cost(l, opt.mesh_index, opt.variant) for l in range(first, last + 1)]
    if splits_data(costs):
        return 0.0, sum(c.apply_s for c in costs)  # the runtime reduces every microbatch (`stage_columns.split_ranges`)
    sync, apply = once_per_step_columns(table, costs, opt)  # a reduction run every microbatch is in the stage time
    return sum(sync), sum(apply)


def once_per_step_max(table: LayerCostTable, st: StageTimes, stages: Sequence[StageChoice]) -> float:
    """The largest per-stage once-per-step term: gradients accumulate over the microbatches and each
    stage reduces them over its data-parallel axes once, after its last backward, then updates.
    Stages do this in parallel; the reduction is charged exposed (its overlap with the other stages'
    remaining backwards under 1F1B is not modelled). The step is the pipeline latency plus this."""
    out = 0.0
    S = len(stages)
    for k, stage in enumerate(stages):
        out = max(out, sum(once_per_step(table, stage_option(st, stage, S - k), stage.first, stage.last)))
    return out


def stage_specs(graph: Graph, layers: Layers, table: LayerCostTable, first: int, last: int,
                opt: StageOption) -> dict[str, Spec]:
    """Sharding of each program input the stage's layers read (from the representative layer's plan)."""
    path_of = dict(zip(graph.inputs, graph.input_paths))
    out: dict[str, Spec] = {}
    for l in range(first, last + 1):
        cost = table.cost(l, opt.mesh_index, opt.variant)
        ext = external_inputs(graph, table.facts[l].ops)
        specs = cost.zero_specs if opt.layout == "sharded-state" else cost.input_specs
        for j, t in enumerate(ext):
            if t in path_of and j < len(specs):
                spec = specs[j]
                if spec is None and j < len(cost.input_specs):
                    spec = cost.input_specs[j]
                if spec is not None:
                    out.setdefault(path_of[t], spec)
    return out


def stage_plans(best: Candidate, shapes: Sequence[tuple[int, int]], meshes: Sequence[LogicalMesh],
                cluster: Cluster) -> tuple[StagePlan, ...]:
    """The candidate's stages as `StagePlan`s: placed on the cluster, with their times, memory and shardings."""
    stages = best.dp.stages
    sizes = [n * m for n, m in shapes]
    S = len(stages)
    placed = place_submeshes([shapes[s.submesh] for s in stages], cluster)
    out = []
    link = boundary_link(cluster)
    for k, stage in enumerate(stages):
        opt = stage_option(best.st, stage, S - k)
        inflight = best.st.inflight[min(S - k, len(best.st.inflight)) - 1]
        lm = meshes[opt.mesh_index]
        comm, hidden = stage_communication(best.table, stage.first, stage.last, opt, sizes[stage.submesh],
                                           best.st.boundary, link)
        data = frozenset().union(*(best.table.cost(l, opt.mesh_index, opt.variant).data_axes
                                   for l in range(stage.first, stage.last + 1)))
        out.append(StagePlan(
            layers=best.layers.names[stage.first: stage.last + 1],
            layer_range=(stage.first, stage.last),
            submesh=shapes[stage.submesh],
            mesh=lm.mesh,
            host_axes=lm.host_axes,
            devices=placed[k],
            state_layout=opt.layout,
            remat=opt.remat,
            kept_layers=opt.kept,
            offloaded_activations=opt.offload_acts,
            prefetch=opt.prefetch,
            offloaded_params=opt.offload_params,
            layer_plans=opt.variant or "planned",
            time_s=stage.time_s,
            apply_s=once_per_step(best.table, opt, stage.first, stage.last)[1],
            grad_sync_s=once_per_step(best.table, opt, stage.first, stage.last)[0],
            memory_bytes=stage_memory(best.table, stage.first, stage.last, opt, sizes[stage.submesh],
                                      best.st.boundary, inflight),
            inflight=inflight,
            specs=MappingProxyType(stage_specs(best.graph, best.layers, best.table, stage.first, stage.last, opt)),
            comm_s=comm,
            hidden_s=hidden,
            data_axes=data,
            collectives=stage_collectives(best.table, stage.first, stage.last, opt),
            send_bytes=float(best.st.boundary[stage.last]) if k < S - 1 else 0.0,
        ))
    return tuple(out)


def to_pipeline_plan(best: Candidate, stages: tuple[StagePlan, ...], options: PlanOptions, cluster: Cluster,
                     t_start: float, timings: dict[str, float], ilp_solves: int, single: float | None,
                     single_free: float | None, candidates: tuple, extra: dict) -> PipelinePlan:
    """The `PipelinePlan` of the chosen candidate (`plan_pipeline` and `fixed_pipeline` alike);
    `extra` adds planning facts of the caller (`PipelinePlanning` fields)."""
    times = [s.time_s for s in stages]
    # The step without communication: stage times less their exposed communication, updates only.
    compute = pipeline_latency([s.time_s - s.comm_s for s in stages], best.B) + max(s.apply_s for s in stages)
    planning = PipelinePlanning(
        planning_time_s=round(time.perf_counter() - t_start, 3),
        **{k: round(v, 3) for k, v in timings.items()},
        ilp_solves=ilp_solves,
        layers=best.layers.num_layers,
        distinct_layers=len(set(best.layers.keys)),
        layer_method=best.layers.method,
        **extra,
    )
    return PipelinePlan(
        stages=stages,
        num_microbatches=best.B,
        schedule=options.schedule,
        step_time_s=best.step_s,
        pipeline_time_s=pipeline_latency(times, best.B),
        bubble_fraction=bubble_fraction(times, best.B),
        single_stage_time_s=single,
        single_stage_time_unconstrained_s=single_free,
        cluster=str(cluster),
        layer_names=best.layers.names,
        candidates=candidates,
        planning=planning,
        compute_time_s=min(compute, best.step_s),
        hidden_communication_s=best.B * max(s.hidden_s for s in stages),
    )
