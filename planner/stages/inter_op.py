"""Inter-op planning: from a train step and a cluster to pipeline stages on submeshes.

    pp = plan_pipeline(train_step, (state, batch), make_cluster(8, 8, "v100", inter_host_gbit=25),
                       PlanOptions(pipeline="auto"))
    print(pp.summary())

For each candidate microbatch count B the step is traced at the microbatch size, its ops grouped
into layers, every distinct layer planned by the intra-op ILP on every logical mesh of every
submesh (once: identical layers share the result), and Alpa's DP picks stage boundaries and
submeshes. With `pipeline="auto"` the best single-stage plan (the whole cluster, no microbatching)
competes too. The batch is the last positional argument; every leaf of it is split along axis 0.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import numpy as np

from planner.configs.baselines import layer_variant_pins
from planner.cost_model import Cluster
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, PlannerError, first_line
from planner.core.units import format_bytes
from planner.graph.trace import Graph, trace
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.plan import stage_way
from planner.search.mesh_plan import make_plan
from planner.search.meshes import candidate_meshes, search_meshes
from planner.core.sharding import Spec, spec_axes
from planner.stages.clustering import Layers, cluster_layers, stacked_inputs, stacked_note
from planner.stages.dp import DPResult, StageChoice, bubble_fraction, pipeline_dp, pipeline_latency
from planner.stages.stage_cost import (
    LAYER_VARIANTS,
    LayerCostTable,
    StageOption,
    boundary_bytes,
    external_inputs,
    stage_collectives,
    stage_communication,
    sync_every_microbatch,
    stage_memory,
    stage_times,
)
from planner.stages.submesh import (
    LogicalMesh,
    boundary_link,
    effective_hardware,
    logical_meshes,
    place_submeshes,
    submesh_shapes,
    tensor_parallel_mesh,
)

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
      layers: names of its layers, in order.
      layer_range: (first, last) layer index, inclusive.
      submesh: (hosts, devices per host).
      mesh: the logical mesh it is planned and run as.
      host_axes: axes of `mesh` that cross hosts.
      devices: device positions in the cluster (host * devices_per_host + device).
      state_layout: "plan" (parameters as the intra-op plan shards them) or "sharded-state"
        (parameters, gradients and optimizer state split over all the stage's devices).
      remat: the backward recomputes the stage's forward (only the stage input is kept).
      layer_plans: "planned" (each layer's own fastest plan) or the hand layout its layers were
        planned in (a `stage_cost.LAYER_VARIANTS` name: parameters, optimizer state and batch pinned
        as that baseline lays them out, the rest planned).
      time_s: forward + backward latency of one microbatch, with the boundary transfers (without the
        data-parallel gradient reduction: gradients accumulate per replica over the microbatches).
      apply_s: the optimizer update, once per step.
      comm_s: the exposed communication inside `time_s` (`stage_cost.stage_communication`).
      hidden_s: communication hidden behind the stage's compute, per microbatch.
      data_axes: names of the axes of `mesh` that split the batch (the gradient reduction's axes).
      memory_bytes: predicted per-device peak with `inflight` microbatches of activations.
      inflight: microbatches whose activations the stage holds at once under the schedule.
      specs: sharding (on `mesh`) of each program input the stage reads: parameters and batch.
      collectives: its layers' planned collectives per microbatch, with the sharded-state layout's
        parameter gathers (`stage_cost.stage_collectives`).
      send_bytes: activation bytes it sends the next stage per microbatch (0 for the last stage).
    """

    layers: tuple[str, ...]
    layer_range: tuple[int, int]
    submesh: tuple[int, int]
    mesh: MeshSpec
    host_axes: tuple[int, ...]
    devices: tuple[int, ...]
    state_layout: str
    remat: bool
    time_s: float
    apply_s: float
    memory_bytes: float
    inflight: int
    specs: Mapping[str, Spec]
    grad_sync_s: float = 0.0
    comm_s: float = 0.0
    hidden_s: float = 0.0
    data_axes: frozenset[str] = frozenset()
    layer_plans: str = "planned"
    collectives: tuple = ()
    send_bytes: float = 0.0

    @property
    def name(self) -> str:
        """How the stage runs, e.g. "plan", "fsdp:sharded-state+remat" (layer plans, state layout, remat)."""
        return stage_way({"layer_plans": self.layer_plans, "state_layout": self.state_layout, "remat": self.remat})

    def to_dict(self) -> dict:
        names = self.mesh.axis_names
        return {
            "layers": list(self.layers),
            "layer_range": list(self.layer_range),
            "submesh": list(self.submesh),
            "mesh": {n: int(s) for n, s in zip(names, self.mesh.shape)},
            "host_axes": [names[a] for a in self.host_axes],
            "devices": list(self.devices),
            "state_layout": self.state_layout,
            "remat": self.remat,
            "layer_plans": self.layer_plans,
            "time_per_microbatch_s": self.time_s,
            "apply_time_s": self.apply_s,
            "grad_sync_time_s": self.grad_sync_s,
            "exposed_communication_per_microbatch_s": self.comm_s,
            "hidden_communication_per_microbatch_s": self.hidden_s,
            "data_axes": sorted(self.data_axes),
            "memory_bytes_per_device": int(self.memory_bytes) if math.isfinite(self.memory_bytes) else None,
            "inflight_microbatches": self.inflight,
            "shardings": {p: [None if not axes else [names[a] for a in axes] for axes in spec]
                          for p, spec in sorted(self.specs.items())},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The inter-op planner's answer.

    Attributes:
      stages: in pipeline order (one stage: no pipelining).
      num_microbatches: B.
      schedule: "1f1b" or "gpipe".
      step_time_s: predicted step: pipeline latency plus the largest per-stage once-per-step term
        (the stage's data-parallel gradient reduction and its update, `_once_per_step_max`).
      compute_time_s: the same step with every stage's communication taken out (stage times less
        their exposed communication, no gradient reduction); `step_time_s - compute_time_s` is the
        exposed communication.
      hidden_communication_s: communication hidden behind compute on the devices of the stage that
        hides most: B times its hidden time per microbatch.
      pipeline_time_s: sum(t_i) + (B - 1) * max(t_i).
      bubble_fraction: share of device time idle in the pipeline.
      single_stage_time_s: best single-stage step on the whole cluster that fits memory (inf: none).
      single_stage_time_unconstrained_s: the same ignoring memory.
      cluster: the cluster in words.
      layer_names: every layer, in order.
      candidates: (B, predicted step time, number of stages) of each microbatch count tried.
      planning: timings and counts of the planning run; `hand_layout_counts` says for which
        microbatch counts the stage tables' hand layouts were priced ("priced") and for which the
        pruning rule skipped them ("pruned": their candidate is of the layers' own plans only).
    """

    stages: tuple[StagePlan, ...]
    num_microbatches: int
    schedule: str
    step_time_s: float
    pipeline_time_s: float
    bubble_fraction: float
    single_stage_time_s: float | None
    single_stage_time_unconstrained_s: float | None
    cluster: str
    layer_names: tuple[str, ...]
    candidates: tuple[tuple[int, float, int], ...]
    planning: Mapping[str, Any]
    compute_time_s: float
    hidden_communication_s: float
    # (plan, inter-host axes): the whole-program plan the single stage was priced with (`pipeline="auto"`), bound to the
    # devices `plan_pipeline` was given; `planned.plan_stages` returns it when one stage wins
    # instead of solving the same ILP again. Not part of the plan's data.
    single_stage_plan: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def memory_bytes_per_device(self) -> float:
        return max(st.memory_bytes for st in self.stages)

    def to_dict(self) -> dict:
        """The pipeline-level facts (stages go separately to `Plan.stages`, see `stage_dicts`)."""
        return {
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "num_stages": self.num_stages,
            "bubble_fraction": self.bubble_fraction,
            "step_time_s": self.step_time_s,
            "compute_time_s": self.compute_time_s,
            "exposed_communication_s": self.step_time_s - self.compute_time_s,
            "hidden_communication_s": self.hidden_communication_s,
            "pipeline_time_s": self.pipeline_time_s,
            "single_stage_step_time_s": _finite(self.single_stage_time_s),
            "single_stage_step_time_ignoring_memory_s": _finite(self.single_stage_time_unconstrained_s),
            "cluster": self.cluster,
            "candidates": [{"num_microbatches": b, "step_time_s": _finite(t), "stages": s}
                           for b, t, s in self.candidates],
            "planning": dict(self.planning),
        }

    def stage_dicts(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(MappingProxyType(st.to_dict()) for st in self.stages)

    def summary(self) -> str:
        lines = [
            f"Pipeline on {self.cluster}: {self.num_stages} stage(s), {self.num_microbatches} microbatches, "
            f"{self.schedule}",
            f"  predicted step time   {self.step_time_s * 1e3:10.3f} ms  (pipeline {self.pipeline_time_s * 1e3:.3f} ms, "
            f"bubble {self.bubble_fraction:.1%})",
        ]
        if self.single_stage_time_s is not None:
            single = "does not fit" if not math.isfinite(self.single_stage_time_s) else \
                f"{self.single_stage_time_s * 1e3:.3f} ms"
            free = self.single_stage_time_unconstrained_s
            lines.append(f"  best single stage     {single}" + (
                f" (ignoring memory {free * 1e3:.3f} ms)" if free is not None and math.isfinite(free) else ""))
        if self.planning.get("stacked_params"):
            lines.append(f"  note: {stacked_note(self.planning['stacked_params'])}")
        for k, st in enumerate(self.stages):
            names = st.layers[0] if len(st.layers) == 1 else f"{st.layers[0]}..{st.layers[-1]} ({len(st.layers)})"
            lines.append(
                f"  stage {k}: {names:<28} submesh {st.submesh[0]}x{st.submesh[1]} mesh {st.mesh} "
                f"{st.name:<19} {st.time_s * 1e3:9.3f} ms/microbatch, "
                f"{format_bytes(st.memory_bytes):>9}/device, devices {_ranges(st.devices)}")
        return "\n".join(lines)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _ranges(ids: Sequence[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1)) else \
        ",".join(map(str, ids))


def _argnums(batch_argnum: int | tuple[int, ...]) -> tuple[int, ...]:
    return (batch_argnum,) if isinstance(batch_argnum, int) else tuple(batch_argnum)


def batch_size(args: tuple[Any, ...], batch_argnum: int | tuple[int, ...] = -1) -> int:
    """The leading dimension shared by every leaf of the batch argument(s)."""
    leaves = jax.tree_util.tree_leaves([args[a] for a in _argnums(batch_argnum)])
    sizes = {int(np.shape(x)[0]) for x in leaves if np.ndim(x) >= 1}
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"the batch argument (position {batch_argnum}) must have leaves with one common leading dimension "
            f"to split into microbatches; found leading dimensions {sorted(sizes)}")
    return sizes.pop()


def microbatch_args(args: tuple[Any, ...], microbatch: int,
                    batch_argnum: int | tuple[int, ...] = -1) -> tuple[Any, ...]:
    """`args` as ShapeDtypeStructs with the batch argument(s)' leaves cut to `microbatch` rows."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    out = list(abstract)
    for a in _argnums(batch_argnum):
        out[a] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((microbatch,) + tuple(x.shape[1:]), x.dtype),
                              abstract[a])
    return tuple(out)


class UntraceableMicrobatches(InvalidArgumentError):
    """The step does not trace on microbatches of some size (`_trace_microbatch`); out of
    `plan_pipeline` / `fixed_pipeline` when no count tried traces (`_none_traces`). A caller that
    knows why the step cannot be split (`stages.derived`) says that instead
    (`planned.plan_with_stages`)."""


def _none_traces(untraceable: Sequence[str], counts: Sequence[int]) -> UntraceableMicrobatches:
    """The one-line error when no microbatch count traces: the first count's reason."""
    return UntraceableMicrobatches(f"{untraceable[0]}; no microbatch count tried traces "
                                   f"({', '.join(map(str, counts))})")


def _trace_microbatch(fn: Callable, args: Sequence[Any], count: int, rows: int, replicas: int = 1) -> Graph:
    """`fn` traced on one microbatch (`args` cut to `rows // replicas` rows: one of `replicas`
    data-parallel replicas' share of it when more than one); a step that cannot run on them (it
    traced on the whole batch: the caller's graph) raises `UntraceableMicrobatches` with the step's
    own error in one line, so the pipeline search drops that microbatch count instead of stopping.
    Found on gshard-moe-1.3b at 1024 microbatches: one 1024-token sequence per microbatch, and its
    experts route tokens in groups of 2048 (a reshape to (0, 2048, 768))."""
    try:
        return trace(fn, *args)
    except PlannerError:
        raise
    except Exception as e:  # the user's step, not the planner: its message, first line
        share = f" split {replicas} ways ({rows // replicas} per data-parallel replica)" if replicas > 1 else ""
        raise UntraceableMicrobatches(f"the step does not trace on {count} microbatches of {rows} rows{share} "
                                      f"({type(e).__name__}: {first_line(e)})") from None


def _trace_replica(fn: Callable, args: tuple[Any, ...], count: int, rows: int, replicas: int,
                   batch_argnum: int | tuple[int, ...] = -1) -> None:
    """Raises `UntraceableMicrobatches` (`_trace_microbatch`) unless `fn` traces on one of
    `replicas` data-parallel replicas' share of a microbatch of `rows` rows, as the pipeline runtime
    traces the loss to accumulate gradients per replica (`runtime.PipelinedStep._replicas`). The
    whole microbatch tracing does not imply it: gshard-moe-1.3b as megatron-tp+pp2 on 128x8 at 16
    microbatches of 64 rows has one 1024-token row per replica of 64, under its 2048-token routing
    groups."""
    if replicas > 1 and rows % replicas == 0:
        _trace_microbatch(fn, microbatch_args(args, rows // replicas, batch_argnum), count, rows, replicas)


def microbatch_counts(batch: int, requested: int | None, limit: int | None = None) -> tuple[int, ...]:
    """Microbatch counts to try: the requested one, else every count >= 2 dividing the batch, largest
    first; with a `limit`, that many of them spread evenly in log scale from the largest count
    (microbatches of one sample: the smallest bubble) to the smallest (the most data parallelism
    inside a stage)."""
    if requested is not None:
        if batch % requested:
            raise InvalidArgumentError(
                f"num_microbatches={requested} does not divide the batch size {batch}; choose a divisor of {batch}")
        return (requested,)
    counts = [b for b in range(batch, 1, -1) if batch % b == 0]
    if limit is None or limit >= len(counts):
        return tuple(counts)
    if limit <= 1:
        return tuple(counts[:limit])
    logs = np.log([float(b) for b in counts])
    picked = {int(np.argmin(np.abs(logs - x))) for x in np.linspace(logs[0], logs[-1], limit)}
    return tuple(counts[i] for i in sorted(picked))


@dataclasses.dataclass(slots=True)
class _Candidate:
    B: int
    graph: Graph
    layers: Layers
    table: LayerCostTable
    st: Any
    dp: DPResult | None
    step_s: float


def _stage_specs(graph: Graph, layers: Layers, table: LayerCostTable, first: int, last: int,
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


def plan_pipeline(fn: Callable[..., Any], args: tuple[Any, ...], cluster: Cluster,
                  options: PlanOptions | None = None, *, batch_argnum: int | tuple[int, ...] = -1,
                  max_mesh_ndim: int = 2,
                  microbatch_limit: int | None = None, rel_gap: float = 0.0, num_layers: int | None = None,
                  full_graph: Graph | None = None,
                  pins: Callable[[Graph, LogicalMesh], Mapping[int, Any]] | None = None,
                  devices: Sequence[Any] = (), layer_variants: Sequence[str] = LAYER_VARIANTS) -> PipelinePlan:
    """Plans pipeline stages for `fn(*args)` on `cluster`.

    Args:
      fn: the train step (traced, never run).
      args: its arguments (arrays or ShapeDtypeStructs); `args[batch_argnum]` is the batch.
      cluster: hosts x devices and their links.
      options: `pipeline` (True: at least two stages; "auto": the single-stage plan on the whole
        cluster without microbatching competes too, priced as the whole-program plan that
        `planned.plan_stages` returns for it, and is reported), `num_microbatches`
        (None: try every count dividing the batch, or the `microbatch_limit` largest), `schedule`,
        `memory_budget` (default: the device memory), `solver_time_limit` for each layer's ILP.
      batch_argnum: position(s) of the batch argument(s).
      max_mesh_ndim: 1 plans submeshes as 1-D meshes only (faster), 2 adds 2-D ones.
      microbatch_limit: how many microbatch counts to try when none is given (None: all).
      rel_gap: relative spacing of the DP's t_max candidates (0: exact).
      num_layers: layer count for balanced clustering when the model has no repeated modules.
      full_graph: `trace(fn, *args)` when the caller already has it (saves a trace).
      pins: `(graph, logical mesh) -> {program input tensor id: Spec}` (`planner.configs.pins.stage_pins`):
        each layer's ILP keeps the pinned inputs it reads as pinned, so a pin applies to the stage
        that holds the pinned leaf; a mesh that cannot take a pin is not used for those layers.
      devices: the devices the plan will run on (none: planned abstractly). The single-stage plan
        of `pipeline="auto"` is made for the first `cluster.num_devices` of them, so that
        `planned.plan_stages` can return it as it is when one stage wins.
      layer_variants: the hand layouts each layer is also planned in (`stage_cost.LAYER_VARIANTS`;
        none with `pins`, which fix the layout themselves).

    Raises:
      InfeasiblePlanError: no stage assignment fits the memory budget.
    """
    options = options or PlanOptions(pipeline=True)
    t_start = time.perf_counter()
    batch = batch_size(args, batch_argnum)
    counts = microbatch_counts(batch, options.num_microbatches, microbatch_limit)
    min_stages = 2 if options.pipeline is True else 1
    budget = options.memory_budget or cluster.hardware.memory_bytes
    shapes = submesh_shapes(cluster.hosts, cluster.devices_per_host)
    meshes: list[LogicalMesh] = []
    per_submesh: list[list[int]] = []
    for shape in shapes:
        idx = []
        for lm in logical_meshes(shape, cluster, max_mesh_ndim):
            idx.append(len(meshes))
            meshes.append(lm)
        per_submesh.append(idx)
    sizes = [n * m for n, m in shapes]
    cache: dict = {}
    timings: dict[str, float] = {"trace_s": 0.0, "layer_costs_s": 0.0, "dp_s": 0.0}
    evaluations = 0

    def build(B: int):
        t0 = time.perf_counter()
        if B == 1 and full_graph is not None:
            graph = full_graph
        else:
            graph = _trace_microbatch(fn, microbatch_args(args, batch // B, batch_argnum), B, batch // B)
        layers = cluster_layers(graph, num_layers)
        timings["trace_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        # The hand layouts as per-layer plan variants (`stage_cost.LAYER_VARIANTS`), unless pins fix the layout.
        variants = {} if pins is not None else {
            name: (lambda m, g=graph, f=layer_variant_pins(name): f(g, m)) for name in layer_variants}
        table = LayerCostTable(graph, layers, tuple(meshes), cluster, options, cache,
                               pins=None if pins is None else (lambda m, g=graph: pins(g, m)), variants=variants)
        return graph, layers, table, t0

    def price(B: int, table: LayerCostTable, boundary: np.ndarray, variants: Sequence[str]):
        t0 = time.perf_counter()
        st = stage_times(table, shapes, per_submesh, B, options.schedule, budget, boundary, variants=variants)
        timings["layer_costs_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        dp = pipeline_dp(st.times, sizes, cluster.num_devices, B, min_stages=min_stages, rel_gap=rel_gap)
        timings["dp_s"] += time.perf_counter() - t0
        step = math.inf if dp is None else dp.objective_s + _once_per_step_max(table, st, dp.stages)
        return st, dp, step

    candidates: list[_Candidate] = []
    stacked: tuple[str, ...] = ()
    untraceable: list[str] = []
    for B in counts:
        try:
            graph, layers, table, _ = build(B)
        except UntraceableMicrobatches as e:  # e.g. an MoE step whose token groups are longer than a microbatch
            log.warning("B=%d: %s; not a candidate", B, e)
            untraceable.append(str(e))
            continue
        if B == counts[0]:
            stacked = tuple(graph.input_paths[i] for i in stacked_inputs(graph, layers))
            if stacked:
                log.warning("%s", stacked_note(stacked))
        st, dp, step = price(B, table, boundary_bytes(graph, layers), ("",))
        if dp is not None:
            evaluations += dp.evaluations
        log.info("B=%d: %s", B, "no pipeline of the per-layer plans fits the budget" if dp is None else
                 f"{len(dp.stages)} stages, predicted {step:.4g} s/step")
        candidates.append(_Candidate(B, graph, layers, table, st, dp, step))
    if not candidates and untraceable and options.pipeline != "auto":  # "auto" still has the single stage
        raise _none_traces(untraceable, counts)

    # The hand layouts (`LayerCostTable.variants`) only help where memory binds: a layer's own plan is
    # the fastest, so a count B whose pipeline of the layers' own plans ignoring memory is no faster
    # than the best pipeline found is not planned in them (a pruning rule, not a proof: a hand
    # layout's layers are never faster, but their gradient reduction, charged once per step, may be).
    hand: dict[str, list[int]] = {"priced": [], "pruned": []}  # microbatch counts, for `planning`
    for k, c in enumerate(candidates):
        if not c.table.variants:
            break
        best_step = min(x.step_s for x in candidates)
        boundary = c.st.boundary
        if math.isfinite(best_step):
            t0 = time.perf_counter()
            free = stage_times(c.table, shapes, per_submesh, c.B, options.schedule, math.inf, boundary,
                               variants=("",))
            bound = pipeline_dp(free.times, sizes, cluster.num_devices, c.B, min_stages=min_stages, rel_gap=rel_gap)
            timings["dp_s"] += time.perf_counter() - t0
            # Memory binds when the count's pipeline is slower than the same ignoring memory.
            free_step = math.inf if bound is None else \
                bound.objective_s + _once_per_step_max(c.table, free, bound.stages)
            if bound is None or bound.objective_s >= best_step or c.step_s <= free_step * (1 + 1e-9):
                hand["pruned"].append(c.B)
                continue
        hand["priced"].append(c.B)
        st, dp, step = price(c.B, c.table, boundary, ("", *c.table.variants))
        if dp is not None:
            evaluations += dp.evaluations
        if step < c.step_s:
            log.info("B=%d with the %s layouts: %d stages, predicted %.4g s/step", c.B, "/".join(c.table.variants),
                     len(dp.stages), step)
            candidates[k] = _Candidate(c.B, c.graph, c.layers, c.table, st, dp, step)

    # The single-stage plan: the whole cluster, the whole batch at once.
    single = single_free = whole = None
    whole_axes: tuple[int, ...] = ()
    searched = False  # the single-stage plan is the mesh search's
    mesh_search = False  # the single stage was searched over every mesh shape (not only priced by the tables)
    full = len(shapes) - 1
    if options.pipeline == "auto":
        graph, layers, table, t0 = build(1)
        st1 = stage_times(table, shapes[full:], [per_submesh[full]], 1, options.schedule, budget,
                          boundary_bytes(graph, layers))
        free = stage_times(table, shapes[full:], [per_submesh[full]], 1, options.schedule, math.inf,
                           boundary_bytes(graph, layers), variants=("",))  # the hand layouts are memory levers
        timings["layer_costs_s"] += time.perf_counter() - t0
        L = layers.num_layers
        single = float(st1.times[0, 0, L - 1, 0])
        single_free = float(free.times[0, 0, L - 1, 0])
        if math.isfinite(single):
            single += _once_per_step_max(table, st1, (StageChoice(0, L - 1, 0, single),))
            # The single stage runs as the whole program's intra-op plan (`planned.plan_stages`), whose
            # prediction hides what the per-layer tables charge exposed (the gradient reduction behind
            # the backward): it competes at that price, on the logical mesh the tables chose.
            t0 = time.perf_counter()
            lm = meshes[st1.options[0][int(st1.option[0, 0, L - 1, 0])].mesh_index]
            whole_axes = lm.host_axes
            bound = lm.mesh.to_jax_mesh(list(devices)[:lm.mesh.size]) if len(devices) >= lm.mesh.size else None
            try:
                whole = make_plan(graph, lm.mesh, dataclasses.replace(
                    options, pipeline=False, memory_budget=budget, inter_host_axes=lm.host_axes,
                    hardware=effective_hardware(cluster)), bound, pins=input_pins(pins, graph, lm))
                single = whole.prediction.step_time_s
            except PlannerError as e:
                log.info("single stage on %s: %s", lm.mesh, e)
                single = math.inf
            timings["single_stage_s"] = time.perf_counter() - t0
        # The tables view the whole cluster as one logical mesh (hosts x devices); the other mesh
        # shapes of its devices (as `planner plan --pipeline off` searches them) may be faster, or fit
        # where that one does not. Searched too when the single stage can compete on time (its table
        # price ignoring memory, of the layers' own plans, is below the best pipeline's: GPT-39B on
        # V100 16 GB, 17x slower single, skips a search of minutes; the hand layouts are memory
        # levers, not counted there), each mesh pruned by its bound against the best so far.
        best_pp = min((c.step_s for c in candidates), default=math.inf)
        held = st1
        mesh_search = pins is None and len(shapes) > 1 and single_free < best_pp
        if mesh_search:
            t0 = time.perf_counter()
            found = _single_stage_search(graph, cluster, options, budget, devices, min(single, best_pp))
            if found is not None and found[0].prediction.step_time_s < single:
                whole, whole_axes = found
                single = whole.prediction.step_time_s
                searched = True
                held = st1 if math.isfinite(st1.times[0, 0, L - 1, 0]) else free  # the stage's bookkeeping
            timings["single_stage_s"] = timings.get("single_stage_s", 0.0) + time.perf_counter() - t0
        if math.isfinite(single_free):
            single_free += _once_per_step_max(table, free, (StageChoice(0, L - 1, 0, single_free),))
        dp1 = None if not math.isfinite(single) else \
            DPResult((StageChoice(0, L - 1, full, float(held.times[0, 0, L - 1, 0])),), single, single, 0)
        candidates.append(_Candidate(1, graph, layers, table, _remap(held, full, len(shapes)), dp1, single))

    feasible = [c for c in candidates if c.dp is not None and math.isfinite(c.step_s)]
    if not feasible:
        hand = f" and in the {', '.join(layer_variants)} layouts" if layer_variants and pins is None else ""
        raise InfeasiblePlanError(
            f"no pipeline of {cluster} built from the per-layer plans (each layer's fastest plan on each "
            f"mesh{hand}, "
            f"with or without recomputation and sharded state) fits the memory budget of {format_bytes(budget)} "
            f"per device for any of "
            f"{list(counts)} microbatches; raise memory_budget, use more devices or more microbatches")
    stage_plans, best, per_microbatch = _cheapest_as_run(
        fn, args, feasible, lambda c: (c.step_s, len(c.dp.stages)),
        lambda c: _stage_plans(c, shapes, meshes, cluster), batch, batch_argnum)
    pp = _pipeline_plan(best, stage_plans, options, cluster, t_start, timings,
                        len(cache), single, single_free,
                        tuple((c.B, c.step_s, len(c.dp.stages) if c.dp else 0) for c in candidates),
                        {"dp_evaluations": evaluations, "logical_meshes": len(meshes),
                         **({"grad_sync_per_microbatch": per_microbatch} if per_microbatch else {}),
                         **({"stacked_params": list(stacked)} if stacked else {}),
                         **({"hand_layout_counts": hand} if layer_variants and pins is None else {}),
                         **({"single_stage_mesh_search": mesh_search} if options.pipeline == "auto" else {})})
    if whole is None or pp.num_stages > 1:
        return pp
    st = pp.stages[0]
    if searched:  # the mesh search's plan won: the stage is that plan
        pred = whole.prediction
        st = dataclasses.replace(
            st, mesh=whole.mesh, host_axes=tuple(whole_axes), state_layout="plan", remat=False,
            time_s=pred.step_time_s, apply_s=0.0, grad_sync_s=0.0, memory_bytes=pred.memory_bytes_per_device,
            specs=MappingProxyType(dict(zip(whole.input_paths, whole.input_specs))),
            comm_s=pred.communication_time_s, hidden_s=pred.hidden_communication_time_s, data_axes=frozenset())
        pp = dataclasses.replace(pp, stages=(st,))
    return dataclasses.replace(pp, single_stage_plan=(whole, whole_axes))


def _cheapest_as_run(fn: Callable, args: tuple[Any, ...], feasible: Sequence[_Candidate], key: Callable,
                     stage_plans_of: Callable, batch: int, batch_argnum: int | tuple[int, ...]
                     ) -> tuple[tuple[StagePlan, ...], _Candidate, list[str]]:
    """The candidate first by `key` (which grows with `step_s`) once priced as the runtime runs it
    (`_replica_fallback`, which only adds time): candidates are re-priced in `key` order until the
    next one cannot beat the best re-priced one. Returns its stage plans, itself re-priced and the
    stages it re-priced (with a warning when there are any)."""
    chosen = None
    for c in sorted(feasible, key=key):
        if chosen is not None and key(c) >= key(chosen[1]):
            break
        found = _replica_fallback(fn, args, c, stage_plans_of(c), batch, batch_argnum)
        if chosen is None or key(found[1]) < key(chosen[1]):
            chosen = found
    if chosen[2]:
        log.warning("the pipeline's data-parallel stages will reduce gradients every microbatch, not once per step "
                    "(%s): predicted %.4g s/step with that", "; ".join(chosen[2]), chosen[1].step_s)
    return chosen


def _replica_fallback(fn: Callable, args: tuple[Any, ...], best: _Candidate, stages: tuple[StagePlan, ...],
                      batch: int, batch_argnum: int | tuple[int, ...]
                      ) -> tuple[tuple[StagePlan, ...], _Candidate, list[str]]:
    """A candidate pipeline priced as the runtime will run it. A data-parallel stage reduces its
    gradients once per step only when each of its replicas' share of a microbatch is whole rows, the
    loss traces on it and no parameter (a program input outside the batch arguments and the
    optimizer state) is split over a data axis (`runtime.PipelinedStep._replicas`); the stage
    tables price that once per step. For a stage where it does not hold, the runtime reduces every
    microbatch: its reduction moves into its per-microbatch time and exposed communication, and the
    step time follows (the pipeline latency of the new stage times, the once-per-step part without
    it). Returns the stages, the candidate with that step time and one line per stage so priced;
    never faster than before (`_cheapest_as_run` relies on it)."""
    rows = batch // best.B
    batch_args = tuple(f"[{a % len(args)}]" for a in _argnums(batch_argnum))
    traces: dict[int, str | None] = {}  # replica count -> why the share does not trace (None: it does)
    new, why = [], []
    for k, st in enumerate(stages):
        axes = {st.mesh.axis_names.index(a) for a in st.data_axes}
        ways = st.mesh.axis_size(tuple(axes))
        if ways <= 1 or not st.grad_sync_s:
            new.append(st)
            continue
        split = [path for path, spec in st.specs.items() if not path.startswith(batch_args)
                 and "opt_state" not in path and axes & spec_axes(spec)]
        if split:
            reason = f"parameter {split[0]} is split over a data axis"
        elif rows % ways:
            reason = f"{rows} rows per microbatch do not split {ways} ways"
        else:
            if ways not in traces:
                try:
                    _trace_replica(fn, args, best.B, rows, ways, batch_argnum)
                    traces[ways] = None
                except UntraceableMicrobatches as e:
                    traces[ways] = str(e)
            reason = traces[ways]
        if reason is None:
            new.append(st)
            continue
        why.append(f"stage {k}: {reason}")
        new.append(dataclasses.replace(st, time_s=st.time_s + st.grad_sync_s, comm_s=st.comm_s + st.grad_sync_s,
                                       grad_sync_s=0.0))
    if not why:
        return stages, best, []
    B = best.B
    step = (best.step_s + pipeline_latency([s.time_s for s in new], B) - pipeline_latency([s.time_s for s in stages], B)
            + max(s.grad_sync_s + s.apply_s for s in new) - max(s.grad_sync_s + s.apply_s for s in stages))
    return tuple(new), dataclasses.replace(best, step_s=step), why


def _single_stage_search(graph: Graph, cluster: Cluster, options: PlanOptions, budget: float,
                         devices: Sequence[Any], beat: float) -> tuple[Any, tuple[int, ...]] | None:
    """The fastest single-stage plan of `graph` on the cluster's mesh shapes (`search.search_meshes`
    with the cluster's links; meshes that cannot beat `beat` pruned), with its inter-host axes; None
    when none fits `budget` or beats `beat`."""
    single = dataclasses.replace(options, pipeline=False, memory_budget=budget, hardware=effective_hardware(cluster))
    bound = list(devices)[:cluster.num_devices] if len(devices) >= cluster.num_devices else None
    results = search_meshes(graph, candidate_meshes(cluster.num_devices), single,
                            devices_per_host=cluster.devices_per_host, devices=bound, beat=beat,
                            min_peak_search=False)
    if not results or results[0].plan is None or results[0].plan.prediction.step_time_s >= beat:
        return None
    return results[0].plan, results[0].inter_host_axes


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


def _pipeline_plan(best: _Candidate, stages: tuple[StagePlan, ...], options: PlanOptions, cluster: Cluster,
                   t_start: float, timings: dict[str, float], ilp_solves: int, single: float | None,
                   single_free: float | None, candidates: tuple, extra: dict) -> PipelinePlan:
    """The `PipelinePlan` of the chosen candidate (`plan_pipeline` and `fixed_pipeline` alike);
    `extra` adds planning facts of the caller."""
    times = [s.time_s for s in stages]
    # The step without communication: stage times less their exposed communication, updates only.
    compute = pipeline_latency([s.time_s - s.comm_s for s in stages], best.B) + max(s.apply_s for s in stages)
    planning = {
        "planning_time_s": round(time.perf_counter() - t_start, 3),
        **{k: round(v, 3) for k, v in timings.items()},
        "ilp_solves": ilp_solves,
        "layers": best.layers.num_layers,
        "distinct_layers": len(set(best.layers.keys)),
        "layer_method": best.layers.method,
        **extra,
    }
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
        planning=MappingProxyType(planning),
        compute_time_s=min(compute, best.step_s),
        hidden_communication_s=best.B * max(s.hidden_s for s in stages),
    )


def _remap(st, full: int, num_submeshes: int):
    """A one-submesh StageTimes seen as the table of all submeshes (only `full` populated)."""
    Q, L = st.times.shape[:2]
    times = np.full((Q, L, L, num_submeshes), np.inf)
    option = np.full((Q, L, L, num_submeshes), -1, dtype=np.int32)
    times[..., full] = st.times[..., 0]
    option[..., full] = st.option[..., 0]
    options = tuple(st.options[0] if m == full else () for m in range(num_submeshes))
    return dataclasses.replace(st, times=times, option=option, options=options)


def _option(st, stage: StageChoice, position: int) -> StageOption:
    q = min(position, len(st.inflight)) - 1
    j = int(st.option[q, stage.first, stage.last, stage.submesh])
    return st.options[stage.submesh][j]


def _once_per_step(table: LayerCostTable, opt: StageOption, first: int, last: int) -> tuple[float, float]:
    """(data-parallel gradient reduction, optimizer update) of the stage of layers first..last."""
    costs = [table.cost(l, opt.mesh_index, opt.variant) for l in range(first, last + 1)]
    return (sum(c.sync_s for c in costs if not sync_every_microbatch(c, opt)),  # the rest is in the stage time
            sum(c.apply_s for c in costs))


def _once_per_step_max(table: LayerCostTable, st, stages: Sequence[StageChoice]) -> float:
    """The largest per-stage once-per-step term: gradients accumulate over the microbatches and each
    stage reduces them over its data-parallel axes once, after its last backward, then updates.
    Stages do this in parallel; the reduction is charged exposed (its overlap with the other stages'
    remaining backwards under 1F1B is not modelled). The step is the pipeline latency plus this."""
    out = 0.0
    S = len(stages)
    for k, stage in enumerate(stages):
        out = max(out, sum(_once_per_step(table, _option(st, stage, S - k), stage.first, stage.last)))
    return out


def _stage_plans(best: _Candidate, shapes, meshes: Sequence[LogicalMesh], cluster: Cluster) -> tuple[StagePlan, ...]:
    stages = best.dp.stages
    sizes = [n * m for n, m in shapes]
    S = len(stages)
    placed = place_submeshes([shapes[s.submesh] for s in stages], cluster)
    out = []
    link = boundary_link(cluster)
    for k, stage in enumerate(stages):
        opt = _option(best.st, stage, S - k)
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
            layer_plans=opt.variant or "planned",
            time_s=stage.time_s,
            apply_s=_once_per_step(best.table, opt, stage.first, stage.last)[1],
            grad_sync_s=_once_per_step(best.table, opt, stage.first, stage.last)[0],
            memory_bytes=stage_memory(best.table, stage.first, stage.last, opt, sizes[stage.submesh],
                                      best.st.boundary, inflight),
            inflight=inflight,
            specs=MappingProxyType(_stage_specs(best.graph, best.layers, best.table, stage.first, stage.last, opt)),
            comm_s=comm,
            hidden_s=hidden,
            data_axes=data,
            collectives=stage_collectives(best.table, stage.first, stage.last, opt),
            send_bytes=float(best.st.boundary[stage.last]) if k < S - 1 else 0.0,
        ))
    return tuple(out)


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
    stage's once-per-step data-parallel gradient sync + update (`_once_per_step_max`).

    Args:
      options: `num_microbatches` (None: every count dividing the batch for which `batch_ways`
        divides the microbatch and the step traces on it and on one of its `replica_ways` shares,
        the fastest kept, as the pipeline search picks it), `schedule`,
        `memory_budget` (default: the device memory; it decides recomputation when `remat` is
        None; a configuration that fits nowhere is costed ignoring memory and says so in
        `planning["fits_memory"]`).
      pins: program input tensor id -> Spec on the stage's logical mesh.
      batch_ways: how many ways the configuration splits the batch dim on that mesh.
      replica_ways: `(microbatch graph, that mesh) ->` how many data-parallel replicas accumulate
        their own gradients there (the pipeline runtime traces the step on each one's share of a
        microbatch, `_trace_replica`); None: none do.
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
    S = num_stages
    shape = even_submesh(cluster, S)
    lm = (logical_meshes(shape, cluster, max_mesh_ndim)[0] if tensor_parallel is None
          else tensor_parallel_mesh(shape, cluster, tensor_parallel))
    batch = batch_size(args, batch_argnum)
    ways = batch_ways(lm) if batch_ways is not None else 1
    counts = [B for B in microbatch_counts(batch, options.num_microbatches) if (batch // B) % ways == 0]
    if not counts:
        given = options.num_microbatches
        raise InvalidArgumentError(
            (f"num_microbatches={given} gives microbatches of {batch // given}" if given else
             f"no microbatch count of the batch {batch} gives microbatches") +
            f" that this configuration splits {ways} ways on each stage's mesh {lm.mesh}; choose a count B with "
            f"{batch} / B a multiple of {ways}")
    budget = options.memory_budget or cluster.hardware.memory_bytes
    remats = (False, True) if remat is None else (bool(remat),)
    cache: dict = {}
    timings = {"trace_s": 0.0, "layer_costs_s": 0.0}
    candidates: list[_Candidate] = []
    fits = {}
    untraceable: list[str] = []
    for B in counts:
        t0 = time.perf_counter()
        try:
            graph = full_graph if B == 1 and full_graph is not None else \
                _trace_microbatch(fn, microbatch_args(args, batch // B, batch_argnum), B, batch // B)
            _trace_replica(fn, args, B, batch // B, replica_ways(graph, lm) if replica_ways else 1, batch_argnum)
        except UntraceableMicrobatches as e:
            log.warning("B=%d: %s; not a candidate", B, e)
            untraceable.append(str(e))
            continue
        layers = cluster_layers(graph, num_layers)
        ranges = even_stage_ranges(layers, S)
        timings["trace_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        table = LayerCostTable(graph, layers, (lm,), cluster, options, cache,
                               pins=None if pins is None else (lambda m, g=graph: pins(g, m)))
        boundary = boundary_bytes(graph, layers)

        def choices(limit: float, st=None):
            st = st or stage_times(table, (shape,), ((0,),), B, options.schedule, limit, boundary,
                                   layouts=("plan",), remats=remats)
            return st, tuple(StageChoice(first, last, 0, float(
                st.times[min(S - k, len(st.inflight)) - 1, first, last, 0])) for k, (first, last) in enumerate(ranges))

        st, chosen = choices(budget)
        fits[B] = all(math.isfinite(c.time_s) for c in chosen)
        if not fits[B]:
            st, chosen = choices(math.inf)
        timings["layer_costs_s"] += time.perf_counter() - t0
        times = [c.time_s for c in chosen]
        step = math.inf
        dp = None
        if all(math.isfinite(t) for t in times):
            latency = pipeline_latency(times, B)
            dp = DPResult(chosen, latency, max(times), 0)
            step = latency + _once_per_step_max(table, st, chosen)
        log.info("B=%d: %d even stages, predicted %.4g s/step%s", B, S, step, "" if fits[B] else " (does not fit)")
        candidates.append(_Candidate(B, graph, layers, table, st, dp, step))
    if not candidates and untraceable:
        raise _none_traces(untraceable, counts)
    feasible = [c for c in candidates if c.dp is not None]
    if not feasible:
        raise InfeasiblePlanError(f"no layer of this configuration can be planned on the stage mesh {lm.mesh}")
    stage_plans, best, per_microbatch = _cheapest_as_run(
        fn, args, feasible, lambda c: (not fits[c.B], c.step_s, -c.B),
        lambda c: _stage_plans(c, (shape,), (lm,), cluster), batch, batch_argnum)
    return _pipeline_plan(best, stage_plans, options, cluster, t_start, timings,
                          len(cache), None, None, tuple((c.B, c.step_s, S) for c in candidates),
                          {"dp_evaluations": 0, "logical_meshes": 1, "stages_chosen": "even (hand-chosen)",
                           "fits_memory": fits[best.B],
                           **({"grad_sync_per_microbatch": per_microbatch} if per_microbatch else {})})
