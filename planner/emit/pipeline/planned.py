"""Pipeline plans through the public API: the cluster a call plans for, a `PipelinePlan` as a
`planner.Plan`, and the callable that runs it.

`plan_parallel(step, pipeline="auto")` plans stages with `plan_pipeline`. When one stage wins, the
result is the ordinary intra-op plan on that stage's mesh (with the pipeline facts attached);
otherwise the Plan records the stages (layers, submesh, logical mesh, devices, shardings) and the
pipeline (schedule, microbatches, bubble), and calling the planned function runs the pipeline
runtime. A step built with `pipelinable(loss_fn, optimizer)` gives the runtime its loss and
optimizer; any other step has them read from its trace (`planner.stages.derived`), or gets the
one-line reason why not. Each stage record keeps the stage's intra-op plan of one microbatch's
forward + backward (`stages[i].plan`), which the runtime emits, and the top-level prediction
lists the pipeline's collectives (`pipeline_collectives`). `run_plan(fn, Plan.from_json(...))`
runs a saved plan.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from planner.cost_model import Cluster, get_hardware, hardware_with_links, ring_bytes
from planner.cost_model.hardware import xla_flags
from planner.emit.single import jit_planned
from planner.core.errors import InvalidArgumentError, PlannerError
from planner.graph.ir import Graph
from planner.graph.trace import trace
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.plan import Plan, PredictedCollective, Prediction
from planner.core.plan_records import SolverStats
from planner.search.mesh_plan import make_plan
from planner.core.sharding import replicated
from planner.stages.derived import DerivedStep
from planner.stages.fixed_pipeline import fixed_pipeline
from planner.stages.inter_op import plan_pipeline
from planner.stages.microbatches import UntraceableMicrobatches, batch_size
from planner.stages.pipeline_plan import PipelinePlan
from planner.stages.single_stage import input_pins
from planner.emit.pipeline.runtime import PipelinedStep, StageLowered
from planner.stages.submesh import LogicalMesh, make_cluster, planning_hardware


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


def pipeline_cluster(mesh: MeshSpec | None, num_devices: int, options: PlanOptions) -> Cluster:
    """`cluster_for`, with the links `options.inter_host` / `options.intra_host` describe (as
    `planner plan --cluster ... --inter-host ...` builds it)."""
    base = cluster_for(mesh, num_devices, options)
    if options.inter_host is None and options.intra_host is None:
        return base
    hw = hardware_with_links(base.hardware, options.inter_host, options.intra_host, base.topo.devices_per_host)
    if base.topology is not None:
        return base.with_links(hw)
    return make_cluster(base.hosts, base.devices_per_host, hw)


def plan_fixed_stages(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, cluster: Cluster,
                      options: PlanOptions, num_stages: int, **kwargs: Any) -> tuple[Plan, PipelinePlan]:
    """A hand-chosen even pipeline (`fixed_pipeline.fixed_pipeline`; `kwargs` go to it) as a `Plan`, with
    every stage's intra-op plan and the stage-to-stage transfers, exactly as `plan_stages` makes
    the planner's own pipeline plans (`run_plan(fn, plan)` runs it)."""
    derived = None if has_marker(fn) else derive(fn, graph)
    if isinstance(derived, DerivedStep) and "batch_argnum" not in kwargs:
        kwargs["batch_argnum"] = derived.batch_argnums()
    pp = fixed_pipeline(fn, args, cluster, options, num_stages, full_graph=graph, **kwargs)
    options = dataclasses.replace(options, pipeline=True, num_microbatches=pp.num_microbatches)
    return to_plan(pp, graph, cluster, options, *stage_plans_for(fn, args, graph, pp, cluster, options)), pp


def to_plan(pp: PipelinePlan, graph: Graph, cluster: Cluster, options: PlanOptions,
            stage_plans: Sequence[Plan] = (), transfers: Sequence[tuple[int, int, float, bool]] = (),
            once: Sequence[Sequence[str]] = ()) -> Plan:
    """A multi-stage pipeline as a `planner.Plan`.

    The top-level mesh is the cluster (hosts x devices) and the top-level shardings are replicated
    placeholders: each stage's real shardings live in `stages[i].shardings` on that stage's
    own mesh (parameters and batch), and its intra-op plan of one microbatch's forward + backward
    in `stages[i].plan` (a `Plan`: the shardings of every intermediate, which the runtime
    emits, and that stage's predicted collectives; `PipelineRunner.lower` gives each stage's
    programs). The prediction is the pipeline's (step time, peak memory of the fullest stage) with
    its collectives (`pipeline_collectives`).
    """
    if cluster.hosts > 1:
        mesh = MeshSpec((cluster.hosts, cluster.devices_per_host), ("host", "device"))
    else:
        mesh = MeshSpec((cluster.devices_per_host,), ("device",))
    rank = [len(graph.tensors[t].shape) if isinstance(t, int) else len(t.tensor.shape) for t in graph.outputs]
    if stage_plans:
        collectives = pipeline_collectives([sp.prediction.collectives for sp in stage_plans], transfers,
                                           pp.num_microbatches, once)
    else:  # no stage programs (a step the runtime cannot split): what the stage tables priced
        collectives = pipeline_collectives(
            [st.collectives for st in pp.stages],
            [(s, s + 1, st.send_bytes, True) for s, st in enumerate(pp.stages[:-1]) if st.send_bytes > 0],
            pp.num_microbatches, [sorted(st.data_axes) for st in pp.stages])
    prediction = Prediction(
        step_time_s=pp.step_time_s,
        compute_time_s=pp.compute_time_s,
        communication_time_s=pp.step_time_s - pp.compute_time_s,
        hidden_communication_time_s=pp.hidden_communication_s,
        memory_bytes_per_device=int(pp.memory_bytes_per_device),
        bytes_moved_per_device=pipeline_bytes_per_device(collectives),
        collectives=collectives,
    )
    if stage_plans:
        records = tuple(st.record(_record(sp)) for st, sp in zip(pp.stages, stage_plans))
    else:
        records = pp.stage_records()
    planning = pp.planning
    solver = SolverStats(status="pipeline",
                         solve_time_s=planning.planning_time_s if planning.planning_time_s is not None else 0.0,
                         planning_time_s=planning.planning_time_s, decisions=planning.ilp_solves,
                         variables_shared=planning.distinct_layers, planning=planning)
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
        options=options.recorded(),
        stages=records,
        pipeline=pp.facts(),
        assumed_xla_flags=pipeline_xla_flags(pp, stage_plans, cluster),
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
    )


def pipeline_xla_flags(pp: PipelinePlan, stage_plans: Sequence[Plan], cluster: Cluster) -> tuple[str, ...]:
    """The XLA flags a pipelined plan's prediction assumes (one process runs every stage's programs
    under one set): its stage plans' (`Plan.assumed_xla_flags`), and the latency-hiding scheduler
    where a stage prefetches its parameter gathers (`StagePlan.prefetch`); a flag two stages set to
    different numbers (a combiner threshold) takes the larger."""
    flags = [f for sp in stage_plans for f in sp.assumed_xla_flags]
    if any(st.prefetch for st in pp.stages):
        flags += list(xla_flags(cluster.hardware, True))
    merged: dict[str, str] = {}
    for flag in flags:
        name, _, value = flag.partition("=")
        old = merged.get(name)
        if old is None or (value.isdigit() and old.isdigit() and int(value) > int(old)):
            merged[name] = value
    return tuple(f"{name}={value}" if value else name for name, value in merged.items())


def pipeline_collectives(stage_collectives: Sequence[Sequence[PredictedCollective]],
                         transfers: Sequence[tuple[int, int, float, bool]], num_microbatches: int,
                         once: Sequence[Sequence[str]] = ()) -> tuple[PredictedCollective, ...]:
    """The collectives of one pipelined step: each stage's (`stage_collectives[s]`: those of its
    intra-op plan of one microbatch's forward + backward, or, when the step's stage programs cannot be
    built, of its layers' plans in the stage tables) repeated per microbatch, so one entry carries
    `num_microbatches` x the bytes, except the data-parallel gradient reduction of a stage that runs it
    once per step on the accumulated gradients (`once[s]`: the axes it reduces over,
    `PipelinedStep.stage_plan_records`; the plan's "partial sum" collectives over only those axes, as
    `layer_cost.grad_sync` takes them out); and per value crossing stages, a collective-permute from the
    sending to the receiving submesh per microbatch (a float value's cotangent returns as many bytes).
    Axes name the stage ("stage0/data")."""
    B = num_microbatches
    out: list[PredictedCollective] = []
    for s, listed in enumerate(stage_collectives):
        data = set(once[s]) if s < len(once) else set()
        for c in listed:
            per_step = c.reason == "partial sum" and bool(c.axes) and set(c.axes) <= data
            n = 1 if per_step else B
            out.append(dataclasses.replace(c, axes=tuple(f"stage{s}/{a}" for a in c.axes), nbytes=c.nbytes * n,
                                           where=f"stage {s} " + ("once per step" if per_step else f"x{B} microbatches")
                                           + f": {c.where}"))
    for src, dst, nbytes, has_ct in transfers:
        out.append(PredictedCollective("collective-permute", (f"stage{src}->stage{dst}",), int(nbytes * B), 2,
                                       f"stage {src} -> stage {dst} x{B} microbatches", "activation"))
        if has_ct:
            out.append(PredictedCollective("collective-permute", (f"stage{dst}->stage{src}",), int(nbytes * B), 2,
                                           f"stage {dst} -> stage {src} x{B} microbatches", "gradient"))
    return tuple(out)


_STAGE = re.compile(r"stage(\d+)")  # the stage an entry of `pipeline_collectives` belongs to (its axes' prefix)


def pipeline_bytes_per_device(collectives: Sequence[PredictedCollective]) -> float:
    """Bytes one device sends in a pipelined step (`pipeline_collectives`' entries): the stages run on
    disjoint devices, so it is the most of any stage, counting its own collectives and the
    stage-to-stage transfers it sends (each entry's axes name its stage first: "stage1/x",
    "stage1->stage2")."""
    per_stage: dict[int, float] = defaultdict(float)
    for c in collectives:
        m = _STAGE.match(c.axes[0]) if c.axes else None
        per_stage[int(m.group(1)) if m else -1] += ring_bytes(c.kind, c.nbytes, c.group_size)
    return float(max(per_stage.values(), default=0.0))


def _record(plan: Plan) -> Plan:
    """A stage's intra-op plan as its stage record keeps it: without the decision table, unbound
    (as a saved plan reads it back)."""
    return dataclasses.replace(plan, decisions=(), in_tree=None, out_tree=None, jax_mesh=None)


def stage_plans_for(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, pp: PipelinePlan,
                    cluster: Cluster, options: PlanOptions, memo: Any = None) -> tuple[tuple[Plan, ...], tuple]:
    """Each stage's intra-op plan of its forward + backward per microbatch, and the values crossing
    stages (`PipelinedStep.stage_plan_records`), for the step `fn(*args)`; ((), (), ()) when the step's
    loss and update cannot be found (running it then says why); a third element names each stage's
    once-per-step gradient reduction axes. `memo`: a `PlanningMemo` whose stage traces and plans by
    program are shared (stages of another cut or batch size that are the same program)."""
    if has_marker(fn):
        loss_fn, update = fn.loss_fn, fn.optimizer
        params, batch = args[0]["params"], args[1]
        rekey = dict
    else:
        derived = derive(fn, graph)
        if isinstance(derived, InvalidArgumentError):
            return (), (), ()
        loss_fn, update, rekey = derived.loss_fn, derived.update, derived.rekey
        params, _, batch = derived.split_args(args)
    positions = list(range(max(d for st in pp.stages for d in st.devices) + 1))
    step = PipelinedStep.from_plan(loss_fn, update, pp, positions)
    layouts = [dataclasses.replace(lay, specs=rekey(lay.specs)) for lay in step.layouts]
    step = PipelinedStep(loss_fn, update, layouts, step.num_microbatches, step.schedule)
    hw = planning_hardware(cluster)
    opts = [dataclasses.replace(options, hardware=hw, inter_host_axes=st.host_axes) for st in pp.stages]
    return step.stage_plan_records(params, batch, opts, memo)


def has_marker(fn: Callable[..., Any]) -> bool:
    """Whether `fn` carries the loss function and optimizer (`pipelinable`)."""
    return getattr(fn, "loss_fn", None) is not None and getattr(fn, "optimizer", None) is not None


def derive(fn: Callable[..., Any], graph: Graph) -> DerivedStep | InvalidArgumentError:
    """The loss and update read from an unmarked step's trace, or the one-line reason they cannot be."""
    try:
        return DerivedStep.of(fn, graph)
    except InvalidArgumentError as e:
        return e


class PipelineRunner:
    """Runs a multi-stage plan (`plan` a `PipelinePlan` or a `planner.Plan` with stages).

    A step built with `pipelinable` runs as `runner(state, batch)` with its state convention; any
    other train step runs with its own signature through the loss and update read from its trace
    (`planner.stages.derived`), or raises the one-line reason it cannot.
    """

    def __init__(self, fn: Callable[..., Any], pp: Any, devices: Sequence[Any], graph: Graph | None = None,
                 stage_plans: Sequence[Plan | None] = ()):
        self.fn, self.pp, self.devices, self.stage_plans = fn, pp, list(devices), tuple(stage_plans)
        self.derived = None if has_marker(fn) or graph is None else derive(fn, graph)
        self._step: PipelinedStep | None = None

    def _runtime(self) -> PipelinedStep:
        if self._step is None:
            if isinstance(self.derived, InvalidArgumentError):
                raise self.derived
            stage_devices = [d for st in self.pp.stages for d in st.devices]
            if len(self.devices) < max(stage_devices) + 1:
                raise InvalidArgumentError(
                    f"the pipeline spans {len(stage_devices)} devices but only "
                    f"{len(self.devices)} are available; it can be planned but not run here")
            if self.derived is None:
                step = PipelinedStep.from_plan(self.fn.loss_fn, self.fn.optimizer, self.pp, self.devices)
                layouts, loss_fn, update = step.layouts, self.fn.loss_fn, self.fn.optimizer
            else:
                step = PipelinedStep.from_plan(self.derived.loss_fn, self.derived.update, self.pp, self.devices)
                layouts = [dataclasses.replace(lay, specs=self.derived.rekey(lay.specs)) for lay in step.layouts]
                loss_fn, update = self.derived.loss_fn, self.derived.update
            self._step = PipelinedStep(loss_fn, update, layouts, step.num_microbatches, step.schedule,
                                       self.stage_plans or step.stage_plans)
        return self._step

    def _prepared(self, args: tuple[Any, ...]) -> PipelinedStep:
        """The runtime for these arguments: an unmarked step's structure is read from its trace once;
        a marked step must be called as (state, batch)."""
        if self.derived is None and not has_marker(self.fn):
            self.derived = derive(self.fn, trace(self.fn, *args))
        step = self._runtime()
        if self.derived is None and len(args) != 2:
            raise InvalidArgumentError(f"a pipelined step takes (state, batch); got {len(args)} arguments")
        return step

    def __call__(self, *args: Any):
        step = self._prepared(args)
        if self.derived is None:
            return step(*args)
        params, carried, batch = self.derived.split_args(args)
        new_params, new_carried, loss = step.step(params, carried, batch)
        return self.derived.join_outputs(args, new_params, new_carried, loss)

    def lower(self, *args: Any) -> tuple[StageLowered, ...]:
        """Every stage's lowered programs (`planner.emit.pipeline.runtime.StageLowered`: forward, backward
        and update per stage, in pipeline order) for these arguments (arrays or ShapeDtypeStructs)."""
        step = self._prepared(args)
        if self.derived is None:
            return step.lower(args[0]["params"], args[0]["opt_state"], args[1])
        params, carried, batch = self.derived.split_args(args)
        return step.lower(params, carried, batch)


def run_plan(fn: Callable[..., Any], plan: Plan, devices: Sequence[Any] | None = None) -> PipelineRunner:
    """The callable that runs a saved multi-stage plan (`Plan.from_json(...)`) of `fn` on `devices`
    (default `jax.devices()`; the plan's device positions index them)."""
    if not plan.stages or plan.stages[0].devices is None:
        raise InvalidArgumentError("this plan has no pipeline stages; run a one-stage plan with plan_parallel")
    return PipelineRunner(fn, plan, jax.devices() if devices is None else devices)


def stage_plans_of(plan: Plan) -> tuple[Plan | None, ...]:
    """The intra-op plans a multi-stage `Plan`'s stage records keep (None where one has none)."""
    return tuple(st.plan for st in plan.stages)


def plan_stages(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, cluster: Cluster, options: PlanOptions,
                devices: Sequence[Any] = (), **kwargs: Any) -> tuple[Plan, PipelinePlan]:
    """Plans pipeline stages for `cluster` and returns the result as a `Plan` with the `PipelinePlan`.

    For one stage (`pipeline="auto"` chose no pipelining) the plan is the intra-op plan on that
    stage's mesh, bound to `devices` when there are enough of them, with the pipeline facts
    attached; for several it is `to_plan(...)`.
    """
    pp = plan_pipeline(fn, args, cluster, options, full_graph=graph, devices=devices, **kwargs)
    if pp.num_stages > 1:
        return to_plan(pp, graph, cluster, options, *_stage_plans(fn, args, graph, pp, cluster, options,
                                                                  kwargs.get("memo"), kwargs.get("batch_argnum", -1))), pp
    st = pp.stages[0]
    plan, host_axes = pp.single_stage_plan or (None, None)
    # The search's own single-stage plan when it is the one this stage needs (same logical mesh and
    # inter-host axes, the devices in order); otherwise the stage's plan is made here.
    if (plan is None or plan.mesh != st.mesh or tuple(host_axes) != tuple(st.host_axes)
            or tuple(st.devices) != tuple(range(len(st.devices)))):
        jax_mesh = st.mesh.to_jax_mesh([devices[i] for i in st.devices]) if max(st.devices) < len(devices) else None
        pinned = input_pins(kwargs.get("pins"), graph, LogicalMesh(st.mesh, (), st.host_axes))
        plan = make_plan(graph, st.mesh, dataclasses.replace(options, inter_host_axes=st.host_axes,
                                                             hardware=planning_hardware(cluster)), jax_mesh, pins=pinned)
    return dataclasses.replace(plan, pipeline=pp.facts()), pp


def _stage_plans(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, pp: PipelinePlan, cluster: Cluster,
                 options: PlanOptions, memo: Any, batch_argnum: int | tuple[int, ...]) -> tuple:
    """`stage_plans_for`, or what it gave for the same stages at the same microbatch size of the same
    step at another batch size (`PlanningMemo.stage_plans`: a stage program depends on its
    microbatch's rows, not on how many there are; `plan_pipeline` keeps the memo's shared entries to
    one step function)."""
    if memo is None:
        return stage_plans_for(fn, args, graph, pp, cluster, options)
    share = memo if memo.step is fn else None  # traces and plans by program: one step function's only
    rows = batch_size(args, batch_argnum) // pp.num_microbatches
    key = (rows, options, tuple((st.layer_range, st.submesh, st.mesh, st.host_axes, st.devices, st.state_layout,
                                 st.remat, st.kept_layers, st.offloaded_activations, st.offloaded_params,
                                 st.layer_plans,
                                 tuple(sorted(st.specs.items())))
                                for st in pp.stages))
    try:
        hash(key)
    except TypeError:  # options holding an unhashable value: nothing to look up by
        return stage_plans_for(fn, args, graph, pp, cluster, options, share)
    if key not in memo.stage_plans:
        memo.stage_plans[key] = stage_plans_for(fn, args, graph, pp, cluster, options, share)
    return memo.stage_plans[key]


def plan_with_stages(fn: Callable[..., Any], args: tuple[Any, ...], graph: Graph, mesh: MeshSpec | None,
                     devices: Sequence[Any], options: PlanOptions, **kwargs: Any) -> tuple[Plan, Any]:
    """The plan and the callable for `plan_parallel(..., pipeline=True/"auto")`.

    Returns:
      (plan, runner): for one stage, the intra-op plan on the chosen mesh and its `jax.jit`
      program; for several, `to_plan(...)` and a `PipelineRunner`.
    """
    cluster = cluster_for(mesh, len(devices), options)
    derived = None if has_marker(fn) else derive(fn, graph)
    if isinstance(derived, DerivedStep) and "batch_argnum" not in kwargs:
        kwargs["batch_argnum"] = derived.batch_argnums()
    try:
        plan, pp = plan_stages(fn, args, graph, cluster, options, devices, **kwargs)
    except UntraceableMicrobatches as e:  # as below, caught by the search: say what the step lacks
        if isinstance(derived, InvalidArgumentError):
            raise derived from e
        raise
    except PlannerError:
        raise
    except (ValueError, TypeError) as e:
        # Microbatched tracing fails when the batch is not the last argument; say what the step lacks.
        if isinstance(derived, InvalidArgumentError):
            raise derived from e
        raise
    if pp.num_stages > 1:
        return plan, PipelineRunner(fn, pp, devices, graph, stage_plans_of(plan))
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
