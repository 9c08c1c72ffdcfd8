"""A pipeline plan's records: each stage (`Plan.stages`), the pipeline's facts (`Plan.pipeline`) and
how its planning went, with their one JSON form."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from planner.core.json_form import JsonRecord, fields_json, from_fields
from planner.core.mesh import MeshSpec
from planner.core.sharding import Spec


@dataclasses.dataclass(frozen=True, slots=True)
class HandLayoutCounts(JsonRecord):
    """For which microbatch counts the stage tables' hand layouts were priced ("priced") and for which
    the pruning rule skipped them ("pruned": their candidate is of the layers' own plans only)."""

    priced: tuple[int, ...] = ()
    pruned: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PipelinePlanning(JsonRecord):
    """How the pipeline's planning went (`PipelinePlan.planning`); a fact a run did not record is None
    (its key absent from the JSON form).

    Attributes:
      planning_time_s, trace_s, layer_costs_s, dp_s, single_stage_s: seconds in all, tracing the
        microbatch steps, the per-layer cost tables, the stage DP and the single stage of
        `pipeline="auto"`.
      ilp_solves, layers, distinct_layers, layer_method, dp_evaluations, logical_meshes: the work
        done: per-layer ILPs solved, layers and distinct ones (and how they were found), DP
        evaluations, logical meshes priced.
      stages_chosen, fits_memory: a hand-chosen pipeline's ("even (hand-chosen)") and whether it
        fits the memory budget (else it is costed ignoring memory).
      grad_sync_per_microbatch, stacked_params, hand_layout_counts, single_stage_mesh_search: the
        stages reducing gradients per microbatch, parameter paths stacked over layers, the hand
        layouts' pricing, and whether the single stage was found by the whole-program mesh search.
      larger_microbatches_skipped: microbatch counts not planned because a count of smaller
        microbatches fit no pipeline in any layout (`inter_op.plan_pipeline`).
      single_stage_bound: why the single stage was not planned at all: a memory floor every mesh of
        the cluster's devices exceeds, carried from a larger batch size of the same step.
      shape_family: "traced once" (every microbatch size of at least 2 rows made from one symbolic
        trace, `graph.shape_family`), or why each size was traced on its own.
    """

    planning_time_s: float | None = None
    trace_s: float | None = None
    layer_costs_s: float | None = None
    dp_s: float | None = None
    single_stage_s: float | None = None
    ilp_solves: int | None = None
    layers: int | None = None
    distinct_layers: int | None = None
    layer_method: str | None = None
    dp_evaluations: int | None = None
    logical_meshes: int | None = None
    stages_chosen: str | None = None
    fits_memory: bool | None = None
    grad_sync_per_microbatch: tuple[str, ...] | None = None
    stacked_params: tuple[str, ...] | None = None
    hand_layout_counts: HandLayoutCounts | None = None
    single_stage_mesh_search: bool | None = None
    single_stage_bound: str | None = None
    larger_microbatches_skipped: tuple[int, ...] | None = None
    shape_family: str | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PipelinePlanning:
        return from_fields(cls, d, hand_layout_counts=HandLayoutCounts.from_json)


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineCandidate(JsonRecord):
    """One microbatch count the pipeline search tried: its predicted step time (None: nothing fits)
    and number of stages."""

    num_microbatches: int
    step_time_s: float | None
    stages: int

    def to_json(self) -> dict:
        return fields_json(self, keep_none=("step_time_s",))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PipelineCandidate:
        return cls(d["num_microbatches"], d["step_time_s"], d["stages"])


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineFacts(JsonRecord):
    """The pipeline-level facts of a plan made with `pipeline=True/"auto"` (`Plan.pipeline`, from
    `planner.stages.PipelinePlan.facts`); a saved plan may give only some (the rest None).

    Attributes:
      schedule, num_microbatches, num_stages, bubble_fraction: the schedule and its shape.
      step_time_s, compute_time_s, exposed_communication_s, hidden_communication_s, pipeline_time_s:
        the predicted step and its parts (see `PipelinePlan`).
      single_stage_step_time_s, single_stage_step_time_ignoring_memory_s: the best single stage on
        the whole cluster, with and without the memory budget (None: none, or not tried).
      cluster, candidates, planning: the cluster in words, each microbatch count tried, and how
        the planning went.
    """

    schedule: str | None = None
    num_microbatches: int | None = None
    num_stages: int | None = None
    bubble_fraction: float | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = None
    exposed_communication_s: float | None = None
    hidden_communication_s: float | None = None
    pipeline_time_s: float | None = None
    single_stage_step_time_s: float | None = None
    single_stage_step_time_ignoring_memory_s: float | None = None
    cluster: str | None = None
    candidates: tuple[PipelineCandidate, ...] | None = None
    planning: PipelinePlanning | None = None

    def to_json(self) -> dict:
        return fields_json(self, keep_none=("single_stage_step_time_s", "single_stage_step_time_ignoring_memory_s"))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PipelineFacts:
        return from_fields(cls, d, candidates=lambda cs: tuple(PipelineCandidate.from_json(c) for c in cs),
                           planning=PipelinePlanning.from_json)


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineStage(JsonRecord):
    """One pipeline stage as the plan keeps it (`Plan.stages`, from `planner.stages.StagePlan.record`);
    a saved plan may give only some facts (the rest None).

    Attributes:
      layers, layer_range, submesh, mesh, host_axes, devices: where it runs: its layers (names, and
        first and last index), its submesh (hosts, devices per host), the logical mesh it is
        planned and run as (axes crossing hosts by name) and its device positions in the cluster.
      state_layout, remat, layer_plans, kept_layers: how it runs (`stage_way`); under `remat`,
        `kept_layers` of its last layers keep their activations (0 or None: none, the whole
        forward is recomputed); `offloaded_activations`: its microbatches' saved activations wait in
        host memory between their forward and backward; `prefetch`: (sharded-state) each layer's
        parameter gather issued behind the compute of the layer before it; `offloaded_params`:
        (offloaded-optimizer) its float32 master parameters wait in host memory with their
        optimizer state, the microbatches reading their cast copies.
      time_per_microbatch_s, apply_time_s, grad_sync_time_s, exposed_communication_per_microbatch_s,
        hidden_communication_per_microbatch_s, data_axes, memory_bytes_per_device (None: it fits
        nowhere), inflight_microbatches: its predicted times, gradient reduction axes and memory.
      shardings: (path, spec on `mesh`) of each program input the stage reads, by path.
      plan: its intra-op `Plan` of one microbatch's forward + backward (without the decision
        table), which the pipeline runtime emits; None where the step's stage programs could not
        be built.
    """

    layers: tuple[str, ...] | None = None
    layer_range: tuple[int, int] | None = None
    submesh: tuple[int, ...] | None = None
    mesh: MeshSpec | None = None
    host_axes: tuple[str, ...] | None = None
    devices: tuple[int, ...] | None = None
    state_layout: str | None = None
    remat: bool | None = None
    layer_plans: str | None = None
    kept_layers: int | None = None
    offloaded_activations: bool | None = None
    prefetch: bool | None = None
    offloaded_params: bool | None = None
    time_per_microbatch_s: float | None = None
    apply_time_s: float | None = None
    grad_sync_time_s: float | None = None
    exposed_communication_per_microbatch_s: float | None = None
    hidden_communication_per_microbatch_s: float | None = None
    data_axes: tuple[str, ...] | None = None
    memory_bytes_per_device: int | None = None
    inflight_microbatches: int | None = None
    shardings: tuple[tuple[str, Spec], ...] | None = None
    plan: Any = None  # a `planner.core.plan.Plan` (this module sits below it)

    def to_json(self) -> dict:
        d = fields_json(self, keep_none=("memory_bytes_per_device",), skip=("mesh", "shardings", "plan"))
        if self.mesh is not None:
            names = self.mesh.axis_names
            d["mesh"] = {n: int(s) for n, s in zip(names, self.mesh.shape)}
        if self.shardings is not None:
            d["shardings"] = {p: [None if not axes else [names[a] for a in axes] for axes in spec]
                              for p, spec in self.shardings}
        if self.plan is not None:
            d["plan"] = {k: v for k, v in self.plan.to_dict().items() if k != "stages"}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], load_plan: Callable[[Mapping[str, Any]], Any]) -> PipelineStage:
        """The stage of its JSON form; `load_plan` reads its intra-op plan (`Plan.from_dict`)."""
        stage = from_fields(cls, d, skip=("mesh", "shardings", "plan"))
        if "mesh" in d:
            mesh = MeshSpec(tuple(int(v) for v in d["mesh"].values()), tuple(d["mesh"]))
            stage = dataclasses.replace(stage, mesh=mesh)
        if d.get("shardings") is not None:
            names = list(stage.mesh.axis_names)
            stage = dataclasses.replace(stage, shardings=tuple(sorted(
                (p, tuple(() if a is None else tuple(names.index(x) for x in a) for a in spec))
                for p, spec in d["shardings"].items())))
        if d.get("plan"):
            stage = dataclasses.replace(stage, plan=load_plan(d["plan"]))
        return stage


def stage_way(stage: PipelineStage) -> str:
    """How a pipeline stage runs: the hand layout its layers were planned in when not their own
    plans ("megatron-tp:"), its state layout, "+remat" when it recomputes its forward, "+remat(last 2
    kept)" when it recomputes all but its last two layers, "+offloaded-activations" when its saved
    activations wait in host memory, "+prefetch" when its parameter gathers are issued ahead,
    "offloaded-optimizer+params" when its master parameters wait in host memory too."""
    plans = stage.layer_plans or "planned"
    remat = "" if not stage.remat else f"+remat(last {stage.kept_layers} kept)" if stage.kept_layers else "+remat"
    hosted = "+offloaded-activations" if stage.offloaded_activations else ""
    ahead = "+prefetch" if stage.prefetch else ""
    masters = "+params" if stage.offloaded_params else ""
    return ("" if plans == "planned" else f"{plans}:") + (stage.state_layout or "-") + masters + remat + hosted + ahead
