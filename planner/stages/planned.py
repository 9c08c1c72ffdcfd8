"""Pipeline plans through the public API: the cluster a call plans for, a `PipelinePlan` as a
`planner.Plan`, and the callable that runs it.

`plan_parallel(step, pipeline="auto")` plans stages with `plan_pipeline`. When one stage wins, the
result is the ordinary intra-op plan on that stage's mesh (with the pipeline facts attached);
otherwise the Plan records the stages (layers, submesh, logical mesh, devices, shardings) and the
pipeline (schedule, microbatches, bubble), and calling the planned function runs the pipeline
runtime. Running needs the marker the runtime needs: build the step with
`pipelinable(loss_fn, optimizer)` (or give the function `loss_fn` and `optimizer` attributes).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

from planner.cost_model import Cluster, get_hardware
from planner.emit import jit_planned
from planner.errors import InvalidArgumentError
from planner.graph import Graph
from planner.mesh import MeshSpec
from planner.options import PlanOptions
from planner.plan import Plan, Prediction
from planner.planning import make_plan
from planner.sharding import replicated
from planner.stages.inter_op import PipelinePlan, plan_pipeline
from planner.stages.runtime import PipelinedStep


def cluster_for(mesh: MeshSpec | None, num_devices: int, options: PlanOptions) -> Cluster:
    """The cluster a call plans for: `options.hardware` when it names one ("8x8:v100"); else hosts
    are the mesh axes in `options.inter_host_axes` (one host when there are none) and devices per
    host the rest, with links and memory from `options.hardware`."""
    if Cluster.is_cluster(options.hardware):
        return Cluster.parse(options.hardware)
    hw = get_hardware(options.hardware)
    size = mesh.size if mesh is not None else num_devices
    if mesh is not None and options.inter_host_axes:
        hosts = math.prod(mesh.shape[a] for a in options.inter_host_axes)
        return Cluster(hosts, size // hosts, hw)
    return Cluster(1, size, hw)


def to_plan(pp: PipelinePlan, graph: Graph, cluster: Cluster, options: PlanOptions) -> Plan:
    """A multi-stage pipeline as a `planner.Plan`.

    The top-level mesh is the cluster (hosts x devices) and the top-level shardings are replicated
    placeholders: each stage's real shardings live in `stages[i]["shardings"]` on that stage's
    own mesh. The prediction is the pipeline's (step time, peak memory of the fullest stage).
    """
    if cluster.hosts > 1:
        mesh = MeshSpec((cluster.hosts, cluster.devices_per_host), ("host", "device"))
    else:
        mesh = MeshSpec((cluster.devices_per_host,), ("device",))
    rank = [len(graph.tensors[t].shape) if isinstance(t, int) else len(t.tensor.shape) for t in graph.outputs]
    prediction = Prediction(
        step_time_s=pp.step_time_s,
        compute_time_s=pp.step_time_s,
        communication_time_s=0.0,
        memory_bytes_per_device=int(pp.memory_bytes_per_device),
        bytes_moved_per_device=0.0,
        collectives=(),
    )
    solver = {"status": "pipeline", "solve_time_s": pp.planning.get("planning_time_s", 0.0),
              "decisions": pp.planning.get("ilp_solves"), "variables_shared": pp.planning.get("distinct_layers"),
              **dict(pp.planning)}
    return Plan(
        mesh=mesh,
        input_paths=graph.input_paths,
        input_specs=tuple(replicated(len(graph.tensors[t].shape)) for t in graph.inputs),
        output_paths=graph.output_paths,
        output_specs=tuple(replicated(r) for r in rank),
        op_specs=(),
        prediction=prediction,
        decisions=(),
        solver=solver,
        options=options.to_json(),
        stages=pp.stage_dicts(),
        pipeline=MappingProxyType(pp.to_dict()),
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
    )


class PipelineRunner:
    """Runs a multi-stage plan: `runner(state, batch)` with the zoo's state convention."""

    def __init__(self, fn: Callable[..., Any], pp: PipelinePlan, devices: Sequence[Any]):
        self.fn, self.pp, self.devices = fn, pp, list(devices)
        self._step: PipelinedStep | None = None

    def _runtime(self) -> PipelinedStep:
        if self._step is None:
            loss_fn, optimizer = getattr(self.fn, "loss_fn", None), getattr(self.fn, "optimizer", None)
            if loss_fn is None or optimizer is None:
                raise InvalidArgumentError(
                    f"the plan has {self.pp.num_stages} pipeline stages; running it needs the train step's loss "
                    "function and optimizer: build the step with planner.stages.pipelinable(loss_fn, optimizer) "
                    "(or set its .loss_fn and .optimizer attributes)")
            if len(self.devices) < max(d for st in self.pp.stages for d in st.devices) + 1:
                raise InvalidArgumentError(
                    f"the pipeline spans {sum(len(st.devices) for st in self.pp.stages)} devices but only "
                    f"{len(self.devices)} are available; it can be planned but not run here")
            self._step = PipelinedStep.from_plan(loss_fn, optimizer, self.pp, self.devices)
        return self._step

    def __call__(self, *args: Any):
        if len(args) != 2:
            raise InvalidArgumentError(f"a pipelined step takes (state, batch); got {len(args)} arguments")
        return self._runtime()(*args)

    def lower(self, *args: Any):
        raise InvalidArgumentError("a pipelined plan has one program per stage and no single lowering; "
                                   "see plan.stages")


def plan_stages(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, cluster: Cluster, options: PlanOptions,
                devices: Sequence[Any] = (), **kwargs: Any) -> tuple[Plan, PipelinePlan]:
    """Plans pipeline stages for `cluster` and returns the result as a `Plan` with the `PipelinePlan`.

    For one stage (`pipeline="auto"` chose no pipelining) the plan is the intra-op plan on that
    stage's mesh, bound to `devices` when there are enough of them, with the pipeline facts
    attached; for several it is `to_plan(...)`.
    """
    pp = plan_pipeline(fn, args, cluster, options, full_graph=graph, **kwargs)
    if pp.num_stages > 1:
        return to_plan(pp, graph, cluster, options), pp
    st = pp.stages[0]
    jax_mesh = st.mesh.to_jax_mesh([devices[i] for i in st.devices]) if max(st.devices) < len(devices) else None
    plan = make_plan(graph, st.mesh, dataclasses.replace(options, inter_host_axes=st.host_axes), jax_mesh)
    return dataclasses.replace(plan, pipeline=MappingProxyType(pp.to_dict())), pp


def plan_with_stages(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, mesh: MeshSpec | None,
                     devices: Sequence[Any], options: PlanOptions, **kwargs: Any) -> tuple[Plan, Any]:
    """The plan and the callable for `plan_parallel(..., pipeline=True/"auto")`.

    Returns:
      (plan, runner): for one stage, the intra-op plan on the chosen mesh and its `jax.jit`
      program; for several, `to_plan(...)` and a `PipelineRunner`.
    """
    cluster = cluster_for(mesh, len(devices), options)
    plan, pp = plan_stages(fn, args, graph, cluster, options, devices, **kwargs)
    if pp.num_stages > 1:
        return plan, PipelineRunner(fn, pp, devices)
    st = pp.stages[0]
    if max(st.devices) < len(devices):
        return plan, jit_planned(graph, plan)
    return plan, _Unrunnable(len(st.devices), len(devices))


class _Unrunnable:
    """Stands in for the program of a plan made for more devices than this process has."""

    def __init__(self, needed: int, have: int):
        self.message = (f"the plan is for {needed} devices but only {have} are available here; "
                        "it can be inspected and saved, not run")

    def __call__(self, *args: Any):
        raise InvalidArgumentError(self.message)

    lower = __call__
