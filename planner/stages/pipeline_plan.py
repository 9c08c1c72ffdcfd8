"""The inter-op planner's answer: each pipeline stage (`StagePlan`) and the pipeline (`PipelinePlan`)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from planner.core.mesh import MeshSpec
from planner.core.pipeline_records import (
    PipelineCandidate,
    PipelineFacts,
    PipelinePlanning,
    PipelineStage,
    stage_way,
)
from planner.core.sharding import Spec
from planner.core.units import format_bytes
from planner.stages.clustering import stacked_note


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
      state_layout: "plan" (parameters as the intra-op plan shards them), "sharded-state"
        (parameters, gradients and optimizer state split over all the stage's devices) or
        "sharded-optimizer" (the optimizer state alone split over the stage's data axes too) or
        "offloaded-optimizer" (that, kept in host memory between updates).
      remat: the backward recomputes the stage's forward (only the stage input is kept).
      kept_layers: under `remat`, how many of its last layers keep their activations instead (0:
        none; `stage_cost.StageOption.kept`).
      offloaded_activations: its microbatches' saved activations wait in host memory between their
        forward and backward (`stage_cost.StageOption.offload_acts`).
      prefetch: (sharded-state) each layer's parameter gather issued behind the compute of the layer
        before it (`stage_cost.StageOption.prefetch`).
      offloaded_params: (offloaded-optimizer) its master parameters wait in host memory with their
        optimizer state (`stage_cost.StageOption.offload_params`).
      layer_plans: "planned" (each layer's own fastest plan) or the hand layout its layers were
        planned in (a `cost_table.LAYER_VARIANTS` name: parameters, optimizer state and batch pinned
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
    kept_layers: int = 0
    offloaded_activations: bool = False
    prefetch: bool = False
    offloaded_params: bool = False

    @property
    def name(self) -> str:
        """How the stage runs, e.g. "plan", "fsdp:sharded-state+remat" (layer plans, state layout, remat)."""
        return stage_way(PipelineStage(layer_plans=self.layer_plans, state_layout=self.state_layout,
                                       remat=self.remat, kept_layers=self.kept_layers,
                                       offloaded_activations=self.offloaded_activations,
                                       prefetch=self.prefetch, offloaded_params=self.offloaded_params))

    def record(self, plan: Any = None) -> PipelineStage:
        """The stage as the plan keeps it (`Plan.stages`), with its intra-op `plan` when given."""
        names = self.mesh.axis_names
        return PipelineStage(
            layers=tuple(self.layers),
            layer_range=tuple(self.layer_range),
            submesh=tuple(self.submesh),
            mesh=self.mesh,
            host_axes=tuple(names[a] for a in self.host_axes),
            devices=tuple(self.devices),
            state_layout=self.state_layout,
            remat=self.remat,
            layer_plans=self.layer_plans,
            kept_layers=(self.kept_layers or None) if self.remat else None,
            offloaded_activations=self.offloaded_activations or None,
            prefetch=self.prefetch or None,
            offloaded_params=self.offloaded_params or None,
            time_per_microbatch_s=self.time_s,
            apply_time_s=self.apply_s,
            grad_sync_time_s=self.grad_sync_s,
            exposed_communication_per_microbatch_s=self.comm_s,
            hidden_communication_per_microbatch_s=self.hidden_s,
            data_axes=tuple(sorted(self.data_axes)),
            memory_bytes_per_device=int(self.memory_bytes) if math.isfinite(self.memory_bytes) else None,
            inflight_microbatches=self.inflight,
            shardings=tuple(sorted(self.specs.items())),
            plan=plan,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The inter-op planner's answer.

    Attributes:
      stages: in pipeline order (one stage: no pipelining).
      num_microbatches: B.
      schedule: "1f1b" or "gpipe".
      step_time_s: predicted step: pipeline latency plus the largest per-stage once-per-step term
        (the stage's data-parallel gradient reduction and its update, `once_per_step_max`).
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
      planning: timings and counts of the planning run (`PipelinePlanning`).
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
    planning: PipelinePlanning
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

    def facts(self) -> PipelineFacts:
        """The pipeline-level facts (`Plan.pipeline`; the stages go to `Plan.stages`, see `stage_records`)."""
        return PipelineFacts(
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            num_stages=self.num_stages,
            bubble_fraction=self.bubble_fraction,
            step_time_s=self.step_time_s,
            compute_time_s=self.compute_time_s,
            exposed_communication_s=self.step_time_s - self.compute_time_s,
            hidden_communication_s=self.hidden_communication_s,
            pipeline_time_s=self.pipeline_time_s,
            single_stage_step_time_s=_finite(self.single_stage_time_s),
            single_stage_step_time_ignoring_memory_s=_finite(self.single_stage_time_unconstrained_s),
            cluster=self.cluster,
            candidates=tuple(PipelineCandidate(b, _finite(t), s) for b, t, s in self.candidates),
            planning=self.planning,
        )

    def stage_records(self) -> tuple[PipelineStage, ...]:
        """Each stage as the plan keeps it (`StagePlan.record`)."""
        return tuple(st.record() for st in self.stages)

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
        if self.planning.stacked_params:
            lines.append(f"  note: {stacked_note(self.planning.stacked_params)}")
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
