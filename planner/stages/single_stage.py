"""The single stage of `pipeline="auto"`: the whole cluster, the whole batch at once, competing
with the pipelines.

Priced first by the layer tables on the cluster's logical mesh, then as the whole program's
intra-op plan (which `planned.plan_stages` runs when one stage wins), and searched over the
cluster's other mesh shapes when it can compete on time.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from planner.core.errors import PlannerError
from planner.core.units import format_bytes
from planner.core.options import PlanOptions
from planner.core.sharding import Spec
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.graph.shape_family import ShapeFamily
from planner.search.mesh_plan import make_plan
from planner.search.candidates import candidate_meshes
from planner.search.meshes import search_meshes
from planner.stages.candidate import Candidate, once_per_step_max
from planner.stages.dp import DPResult, StageChoice
from planner.stages.layer_facts import boundary_bytes
from planner.stages.pipeline_plan import PipelinePlan
from planner.stages.search_space import SearchSpace, layer_table
from planner.stages.stage_cost import StageTimes, stage_times
from planner.stages.submesh import LogicalMesh, planning_hardware

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class SingleStage:
    """The single stage's prices and plan.

    Attributes:
      time_s: the step it competes at (inf: it does not fit).
      free_s: its table price ignoring memory, in the layers' own plans.
      whole: the whole-program plan it runs as (None: none made).
      whole_axes: that plan's inter-host axes.
      searched: the plan is the mesh search's (not the one on the tables' logical mesh).
      mesh_search: whether the cluster's mesh shapes were searched.
      bound: why it was not planned at all (`floor_from_larger_batch`); empty where it was.
    """

    time_s: float
    free_s: float
    whole: Any = None
    whole_axes: tuple[int, ...] = ()
    searched: bool = False
    mesh_search: bool = False
    bound: str = ""


def single_stage(space: SearchSpace, best_pp: float) -> tuple[Candidate | None, SingleStage]:
    """The single stage as a candidate of one microbatch, and its prices; `best_pp`: the best
    pipeline's step time (the mesh search is pruned by it). No candidate where a larger batch size
    of the same step shows that it fits no mesh (`floor_from_larger_batch`)."""
    bound = floor_from_larger_batch(space)
    if bound is not None:
        log.info("single stage: %s: not planned", bound)
        return None, SingleStage(math.inf, math.inf, bound=bound)
    graph, layers, table, t0 = layer_table(space, 1)
    full = len(space.shapes) - 1
    on_full = (space.shapes[full:], [space.per_submesh[full]], 1, space.options.schedule)
    st1 = stage_times(table, *on_full, space.budget, boundary_bytes(graph, layers))
    free = stage_times(table, *on_full, math.inf, boundary_bytes(graph, layers),
                       variants=("",))  # the hand layouts are memory levers
    space.timings["layer_costs_s"] += time.perf_counter() - t0
    L = layers.num_layers
    one = SingleStage(float(st1.times[0, 0, L - 1, 0]), float(free.times[0, 0, L - 1, 0]))
    if math.isfinite(one.time_s):
        one = _as_whole_program(space, graph, st1, one, L)
    one, held = _mesh_searched(space, graph, st1, free, one, best_pp, L)
    if math.isfinite(one.free_s):
        one = dataclasses.replace(one, free_s=one.free_s + once_per_step_max(
            table, free, (StageChoice(0, L - 1, 0, one.free_s),)))
    dp1 = None if not math.isfinite(one.time_s) else \
        DPResult((StageChoice(0, L - 1, full, float(held.times[0, 0, L - 1, 0])),), one.time_s, one.time_s, 0)
    return Candidate(1, graph, layers, table, _remap(held, full, len(space.shapes)), dp1, one.time_s), one


def _as_whole_program(space: SearchSpace, graph: Graph, st1: StageTimes, one: SingleStage, L: int) -> SingleStage:
    """The single stage priced as the whole program's intra-op plan (`planned.plan_stages` runs it),
    whose prediction hides what the per-layer tables charge exposed (the gradient reduction behind
    the backward): it competes at that price, on the logical mesh the tables chose."""
    t0 = time.perf_counter()
    lm = space.meshes[st1.options[0][int(st1.option[0, 0, L - 1, 0])].mesh_index]
    devices = space.devices
    bound = lm.mesh.to_jax_mesh(list(devices)[:lm.mesh.size]) if len(devices) >= lm.mesh.size else None
    try:
        whole = make_plan(graph, lm.mesh, dataclasses.replace(
            space.options, pipeline=False, memory_budget=space.budget, inter_host_axes=lm.host_axes,
            hardware=planning_hardware(space.cluster)), bound, pins=input_pins(space.pins, graph, lm))
        one = dataclasses.replace(one, time_s=whole.prediction.step_time_s, whole=whole, whole_axes=lm.host_axes)
    except PlannerError as e:
        log.info("single stage on %s: %s", lm.mesh, e)
        one = dataclasses.replace(one, time_s=math.inf, whole_axes=lm.host_axes)
    space.timings["single_stage_s"] = time.perf_counter() - t0
    return one


def _mesh_searched(space: SearchSpace, graph: Graph, st1: StageTimes, free: StageTimes, one: SingleStage,
                   best_pp: float, L: int) -> tuple[SingleStage, StageTimes]:
    """The single stage after a search over the cluster's mesh shapes, and the stage table that keeps
    its bookkeeping.

    The tables view the whole cluster as one logical mesh (hosts x devices); the other mesh shapes
    of its devices (as `planner plan --pipeline off` searches them) may be faster, or fit where that
    one does not. They are searched when the single stage can compete on time (its table price
    ignoring memory, of the layers' own plans, is below the best pipeline's, so a single stage far
    slower than the pipelines skips a long search; the hand layouts are memory levers, not counted
    there), each mesh pruned by its bound against the best so far."""
    held = st1
    mesh_search = space.pins is None and len(space.shapes) > 1 and one.free_s < best_pp
    one = dataclasses.replace(one, mesh_search=mesh_search)
    if not mesh_search:
        return one, held
    t0 = time.perf_counter()
    found, floor = _single_stage_search(graph, space.cluster, space.options, space.budget, space.devices,
                                        min(one.time_s, best_pp))
    if floor is not None:
        space.single_floors.setdefault(_floor_key(space), []).append((space.batch, floor))
    if found is not None and found[0].prediction.step_time_s < one.time_s:
        whole, whole_axes = found
        one = dataclasses.replace(one, time_s=whole.prediction.step_time_s, whole=whole, whole_axes=whole_axes,
                                  searched=True)
        held = st1 if math.isfinite(st1.times[0, 0, L - 1, 0]) else free  # the stage's bookkeeping
    space.timings["single_stage_s"] = space.timings.get("single_stage_s", 0.0) + time.perf_counter() - t0
    return one, held


def as_single_stage_plan(pp: PipelinePlan, one: SingleStage | None) -> PipelinePlan:
    """`pp` with the single stage's whole-program plan attached when one stage won (its stage
    replaced by that plan when the mesh search found it)."""
    if one is None or one.whole is None or pp.num_stages > 1:
        return pp
    if one.searched:  # the mesh search's plan won: the stage is that plan
        whole, pred = one.whole, one.whole.prediction
        st = dataclasses.replace(
            pp.stages[0], mesh=whole.mesh, host_axes=tuple(one.whole_axes), state_layout="plan", remat=False,
            kept_layers=0, offloaded_activations=False, prefetch=False, offloaded_params=False,
            time_s=pred.step_time_s, apply_s=0.0, grad_sync_s=0.0, memory_bytes=pred.memory_bytes_per_device,
            specs=MappingProxyType(dict(zip(whole.input_paths, whole.input_specs))),
            comm_s=pred.communication_time_s, hidden_s=pred.hidden_communication_time_s, data_axes=frozenset())
        pp = dataclasses.replace(pp, stages=(st,))
    return dataclasses.replace(pp, single_stage_plan=(one.whole, one.whole_axes))


def _single_stage_search(graph: Graph, cluster: Cluster, options: PlanOptions, budget: float,
                          devices: Sequence[Any], beat: float) -> tuple[tuple[Any, tuple[int, ...]] | None, float | None]:
    """The fastest single-stage plan of `graph` on the cluster's mesh shapes (`search.meshes.search_meshes`
    with the cluster's links; meshes that cannot beat `beat` pruned), with its inter-host axes (None
    when none fits `budget` or beats `beat`); and where every mesh was over the budget by its memory
    bound alone, the least of those bounds (else None)."""
    single = dataclasses.replace(options, pipeline=False, memory_budget=budget, hardware=planning_hardware(cluster))
    bound = list(devices)[:cluster.num_devices] if len(devices) >= cluster.num_devices else None
    results = search_meshes(graph, candidate_meshes(cluster.num_devices), single,
                            devices_per_host=cluster.devices_per_host, devices=bound, beat=beat,
                            min_peak_search=False)
    bounds = [getattr(r.error, "lower_bound_bytes", None) if r.over_bound else None
              for r in results if r.same_as is None]  # a mesh's axes permuted: that mesh's problem
    floor = min(bounds) if bounds and None not in bounds else None
    if not results or results[0].plan is None or results[0].plan.prediction.step_time_s >= beat:
        return None, floor
    return (results[0].plan, results[0].inter_host_axes), floor


def _floor_key(space: SearchSpace) -> tuple:
    return space.cluster.num_devices, dataclasses.replace(space.options, memory_budget=None)


def floor_from_larger_batch(space: SearchSpace) -> str | None:
    """Why the single stage fits no mesh at this batch size, from a larger one B of the same step
    (one symbolic trace) that it divides, whose single stage was over the budget on every mesh by
    the meshes' memory bounds alone (the least of them F): at b rows each bound is at least F * b / B.
    Every tensor's bytes are a + c * b with a, c >= 0 (the family's shapes are linear in the batch),
    a sharding valid at b is valid at B (b divides B, so a split of a batch dimension at b splits it
    at B), and a bound sums the least shards of the values live together: each term scales by at
    least b / B. None where no such batch size was planned or the scaled bound fits."""
    if not isinstance(space.graphs.family, ShapeFamily):
        return None
    b = space.batch
    for B, floor in space.single_floors.get(_floor_key(space), ()):
        if B > b and B % b == 0 and floor * b / B > space.budget:
            return (f"every plan on {space.cluster.num_devices} devices needs >= {format_bytes(floor * b / B)}/device "
                    f"(batch {B}'s memory bound {format_bytes(floor)}, scaled to batch {b})")
    return None


def input_pins(pins, graph: Graph, lm: LogicalMesh) -> dict[int, Spec] | None:
    """`pins` as `make_plan` takes them (program input position -> Spec) on `lm`; a pin the mesh
    cannot take raises its error."""
    if pins is None:
        return None
    by_tensor = pins(graph, lm)
    for v in by_tensor.values():
        if isinstance(v, Exception):
            raise v
    return {i: by_tensor[t] for i, t in enumerate(graph.inputs) if t in by_tensor}


def _remap(st: StageTimes, full: int, num_submeshes: int) -> StageTimes:
    """A one-submesh StageTimes seen as the table of all submeshes (only `full` populated)."""
    Q, L = st.times.shape[:2]
    times = np.full((Q, L, L, num_submeshes), np.inf)
    option = np.full((Q, L, L, num_submeshes), -1, dtype=np.int32)
    times[..., full] = st.times[..., 0]
    option[..., full] = st.option[..., 0]
    options = tuple(st.options[0] if m == full else () for m in range(num_submeshes))
    return dataclasses.replace(st, times=times, option=option, options=options)
