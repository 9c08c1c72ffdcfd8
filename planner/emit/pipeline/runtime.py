"""The pipeline runtime: per-stage programs on submeshes, driven by a GPipe or 1F1B schedule.

    step = PipelinedStep.from_plan(loss_fn, optimizer, pipeline_plan)
    state, metrics = step(state, batch)           # state = {"params": ..., "opt_state": ...}

The user marker is the split of the train step into its two halves: `loss_fn(params, batch)`
(a scalar mean over the batch) and an optax optimizer, exactly the pieces
`planner.pipelinable(loss_fn, optimizer)` assembles (Alpa needed `alpa.grad` for the
same reason: an opaque train step does not say where the gradient is). Nothing else changes: the
step takes and returns the usual state pytree, and computes the same loss and update as
`pipelinable(loss_fn, optimizer)` on the whole batch.

How it runs:
  * `loss_fn` is traced at the microbatch size and its ops grouped into the planner's layers
    (`cluster_layers`: the model's repeated modules by name, else balanced clustering matched to
    the stages' layers by position); each stage owns the ops of its layers, the parameters it
    reads first, and the batch leaves it reads.
  * Stage s's ops and their `jax.vjp` are traced into one program per microbatch
    (`programs.StageGraph`) and planned by the intra-op ILP on the stage's mesh, with its
    parameter, batch and boundary shardings pinned (or the plan a saved pipeline plan recorded
    for it is used). Stage s gets three `jax.jit` programs on its submesh (a `jax.sharding.Mesh`
    over its devices): forward (its outputs and the residuals the backward reads, or nothing extra
    under remat; keeping its last layers, their residuals and the stage's inputs) and backward
    (cotangents in, gradient accumulator and input cotangents out), the
    two halves of that program with `with_sharding_constraint` on every planned intermediate, and
    the optimizer update of its own parameters.
  * Activations and cotangents move between submeshes with `jax.device_put` to the receiving
    stage's sharding. Tasks are dispatched in the schedule's order from one thread; JAX's
    asynchronous dispatch runs the submeshes concurrently.
  * Each microbatch's loss is seeded with cotangent 1/B, so the accumulated gradient is the
    gradient of the mean loss over the whole batch.
  * A stage whose batch is split over mesh axes accumulates its gradients per data-parallel
    replica and reduces them once per step, in its update (`programs.Replica`; `replica_grads=False`
    reduces them in every microbatch's backward instead). A stage falls back to the latter when
    a value it exchanges is neither batch-major nor the loss, or a parameter is split over a data axis.

The optimizer must update each parameter from its own gradient and state (AdamW, SGD, ...; not
global-norm clipping): each stage runs it on its own parameters, with the optimizer state leaves
that mirror them and a copy of the shared ones (e.g. the step count).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from planner.graph.batch_mixing import mixing_ops, summary
from planner.graph.trace import trace
from planner.core.errors import InvalidArgumentError
from planner.ilp.strategies import shard_bytes
from planner.core.mesh import MeshSpec
from planner.core.plan import Plan
from planner.core.sharding import named_sharding
from planner.emit.pipeline.layout import StageLayout, even_layouts, layer_names
from planner.emit.pipeline.lowered import StageLowered
from planner.emit.pipeline.opt_state import StateLayouts, opt_layouts, opt_shardings, parameter_groups, state_layouts
from planner.emit.pipeline.programs import build_programs, replica_sharding
from planner.emit.pipeline.stage_reuse import StageGraphs
from planner.emit.pipeline.stage_records import StageWork, stage_plans, stage_records
from planner.stages.derived import is_float
from planner.stages.schedule import dispatch_order, stage_tasks
from planner.stages.stage_cost import OPTIMIZER_LAYOUTS

log = logging.getLogger("planner")


def _put(x: Any, sharding: Any) -> Any:
    """An input of the step (a parameter, optimizer-state or batch leaf) with `sharding`: itself
    when it has it already (the parameters and optimizer state a step handed back), else a
    `jax.device_put` (host time per leaf even when nothing moves). Where `sharding` names devices
    of other processes too (stages on several hosts, `jax.distributed`) and this process holds
    `x` whole (a host array, or an array on one device of its own: every process holds the same
    value, as each computes the same initial state), each process places the shards its devices
    hold (`jax.make_array_from_callback`); any other array (what a step handed back, on a stage's
    mesh) is the processes' one array and moves by `_send`, which every process decides alike."""
    if getattr(x, "sharding", None) == sharding:
        return x
    if (jax.process_count() > 1 and isinstance(x, jax.Array)
            and not isinstance(x.sharding, jax.sharding.SingleDeviceSharding)):
        return _send(x, sharding)  # an array of the processes' (what a step handed back): moved by global facts
    if not sharding.is_fully_addressable and (not isinstance(x, jax.Array) or x.is_fully_addressable):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)
    return jax.device_put(x, sharding)


def _send(x: jax.Array, sharding: Any) -> jax.Array:
    """An activation or cotangent `x` moved to a stage's `sharding`: `jax.device_put` in one
    process. Across processes (stages on different hosts, `jax.distributed`), every process runs
    this with the same arguments and takes the same branch (it depends on which processes own
    the devices only): a process holding neither end gets a handle with no shards of its own
    (`_elsewhere`: the programs of stages it does not run take it and execute nowhere here); JAX
    moves an array between processes only between shardings of one tiling on as many devices
    (`jax.device_put`'s cross-host transfer), so `x` is first laid out on its own devices in the
    receiving layout (the target's mesh shape over the source's devices) and moved; between
    stages of different sizes it goes whole from one sending device to one receiving device
    and is laid out there (more bytes than the plan priced: the receiving stage's share on every
    device)."""
    src = x.sharding
    if src == sharding:
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    src_procs = {d.process_index for d in src.device_set}
    dst_procs = {d.process_index for d in sharding.device_set}
    me = jax.process_index()
    if me not in src_procs | dst_procs:
        return _elsewhere(x, sharding)
    if src_procs == dst_procs == {me}:
        return jax.device_put(x, sharding)
    mesh = sharding.mesh
    src_devices = src.mesh.devices if isinstance(src, jax.sharding.NamedSharding) else \
        np.array(sorted(src.device_set, key=lambda d: d.id))
    if src_devices.size == mesh.devices.size:
        here = jax.sharding.Mesh(src_devices.reshape(mesh.devices.shape), mesh.axis_names)
        staged = jax.jit(lambda a: a, out_shardings=jax.sharding.NamedSharding(here, sharding.spec))(x)
        return jax.device_put(staged, sharding)
    if len(dst_procs) > 1:
        raise InvalidArgumentError(
            f"a stage on the devices of {len(dst_procs)} processes receives a value from a stage of another "
            "size on another process, which the pipeline runtime cannot move; plan stages of one process each")
    a0, b0 = src_devices.flat[0], mesh.devices.flat[0]
    one = jax.sharding.PartitionSpec()
    names = tuple(f"d{k}" for k in range(src_devices.ndim))
    whole = jax.jit(lambda a: a, out_shardings=jax.sharding.NamedSharding(jax.sharding.Mesh(src_devices, names), one))(x)
    single = jax.make_array_from_single_device_arrays(
        x.shape, jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([a0]), ("d",)), one),
        [sh.data for sh in whole.addressable_shards if sh.device == a0], dtype=x.dtype)
    moved = jax.device_put(single, jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([b0]), ("d",)), one))
    if me not in dst_procs:
        return _elsewhere(x, sharding)
    return jax.device_put(moved, sharding)


def _elsewhere(x: jax.Array, sharding: Any) -> jax.Array:
    """A handle of `x`'s shape and type in `sharding` for a process that owns none of its devices."""
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [], dtype=x.dtype)


def _axis_indices(mesh: MeshSpec, names) -> tuple[int, ...]:
    """Positions in `mesh` of the axis `names` a plan records (`StagePlan.data_axes`)."""
    return tuple(sorted(mesh.axis_names.index(a) for a in names))


__all__ = ["PipelinedStep", "StageLayout", "StageLowered", "even_layouts", "layer_names"]


class PipelinedStep:
    """A train step run as a pipeline (see the module docstring).

    Args:
      loss_fn: (params, batch) -> scalar mean loss.
      optimizer: an optax GradientTransformation that updates each parameter on its own.
      stages: the stage layouts, in pipeline order.
      num_microbatches: B; the batch size must be a multiple of it.
      schedule: "1f1b" or "gpipe".
      replica_grads: accumulate gradients per data-parallel replica, reduced once per step.
    """

    def __init__(self, loss_fn: Callable[..., Any], optimizer: Any, stages: Sequence[StageLayout],
                 num_microbatches: int, schedule: str = "1f1b", stage_plans: Sequence[Any] = (),
                 replica_grads: bool = True):
        if not stages:
            raise InvalidArgumentError("a pipeline needs at least one stage")
        if not (isinstance(num_microbatches, int) and num_microbatches >= 1):
            raise InvalidArgumentError(f"num_microbatches={num_microbatches!r} must be an int >= 1")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.layouts = tuple(stages)
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.stage_plans = tuple(stage_plans)
        self.replica_grads = bool(replica_grads)
        self.tasks = stage_tasks(schedule, len(self.layouts), num_microbatches)
        self.order = dispatch_order(self.tasks)
        self._built: dict[tuple, tuple] = {}
        self._state: dict[tuple, StateLayouts] = {}  # by the same signature as `_built`
        self._mixing_said = False

    def with_schedule(self, schedule: str) -> PipelinedStep:
        """The same stages and compiled programs under another schedule."""
        other = PipelinedStep(self.loss_fn, self.optimizer, self.layouts, self.num_microbatches, schedule,
                              self.stage_plans, self.replica_grads)
        other._built, other._state, other._mixing_said = self._built, self._state, self._mixing_said
        return other

    @classmethod
    def from_plan(cls, loss_fn: Callable[..., Any], optimizer: Any, plan: Any,
                  devices: Sequence[Any] | None = None) -> PipelinedStep:
        """From a `PipelinePlan`, or a `planner.Plan` whose `stages` and `pipeline` carry one.

        Stage device positions index `devices` (default `jax.devices()`), host-major.
        """
        devices = list(jax.devices() if devices is None else devices)
        if hasattr(plan, "num_microbatches") and hasattr(plan, "stages"):
            B, schedule = plan.num_microbatches, plan.schedule
            stages = [StageLayout(tuple(st.layers), tuple(devices[i] for i in st.devices), st.mesh,
                                  dict(st.specs), st.remat, _axis_indices(st.mesh, st.data_axes),
                                  st.state_layout in OPTIMIZER_LAYOUTS, st.state_layout == "offloaded-optimizer",
                                  st.kept_layers if st.remat else 0, st.offloaded_activations, st.offloaded_params)
                      for st in plan.stages]
        else:
            info = getattr(plan, "pipeline", None)
            if not plan.stages or plan.stages[0].devices is None:
                raise InvalidArgumentError("this plan has no pipeline stages; plan with pipeline=True or 'auto'")
            B = int(info.num_microbatches if info is not None and info.num_microbatches is not None else 1)
            schedule = info.schedule if info is not None and info.schedule is not None else "1f1b"
            stages = [StageLayout(tuple(st.layers), tuple(devices[i] for i in st.devices), st.mesh,
                                  dict(st.shardings or ()), bool(st.remat),
                                  _axis_indices(st.mesh, st.data_axes) if st.data_axes is not None else None,
                                  st.state_layout in OPTIMIZER_LAYOUTS, st.state_layout == "offloaded-optimizer",
                                  (st.kept_layers or 0) if st.remat else 0, bool(st.offloaded_activations),
                                  bool(st.offloaded_params))
                      for st in plan.stages]
            return cls(loss_fn, optimizer, stages, B, schedule, [st.plan for st in plan.stages])
        return cls(loss_fn, optimizer, stages, B, schedule)

    # ----- building ------------------------------------------------------------------------
    def _layout(self, params: Any, batch: Any, traces: StageGraphs | None = None):
        """What each stage runs, devices aside (`stage_records.stage_records`; `traces`: its
        traces to share)."""
        return stage_records(self.loss_fn, self.layouts, self.num_microbatches, self.replica_grads, params, batch,
                             traces)

    def _say_if_mixing(self, graph, params: Any, batch: Any, mb: int) -> None:
        """Logs once, when the stages are planned, that the loss mixes the examples of its batch
        (`batch_mixing`): the pipelined step then legitimately differs from the plain one. Read from
        the microbatch's trace (`graph`), or where that holds one example (a batch dimension of size
        1, which reshapes may drop or move: nothing to follow) from the loss traced at two."""
        if self.num_microbatches < 2 or self._mixing_said:
            return
        self._mixing_said = True
        n_params = len(jax.tree_util.tree_leaves(params))
        if mb == 1:
            two = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2,) + tuple(np.shape(x)[1:]), x.dtype), batch)
            graph = trace(self.loss_fn, jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params),
                          two)
        found = mixing_ops(graph, graph.inputs[n_params:], graph.outputs[0])
        if found:
            log.warning("loss_fn is not microbatch-invariant: %s; the pipeline computes it on each of %d "
                        "microbatches of %d examples and averages, so its loss and gradients differ from the "
                        "unpipelined step's", summary(found), self.num_microbatches, mb)

    def _stage_plans(self, stages: Sequence[StageWork], options: Any = None,
                     solved: dict | None = None) -> tuple[Plan, ...]:
        """Every stage's intra-op `Plan` (`stage_records.stage_plans`): the one given in
        `stage_plans` when it was made for this program, else planned now (once per distinct
        stage; `solved`: plans by program shared with other calls)."""
        return stage_plans(stages, self.stage_plans, options, solved)

    def stage_plan_records(self, params: Any, batch: Any, options: Any = None, shared: Any = None
                           ) -> tuple[tuple[Plan, ...], tuple, tuple[tuple[str, ...], ...]]:
        """Every stage's intra-op plan (`_stage_plans`; `options` one `PlanOptions` or one per stage)
        and the values crossing stages, without devices (layout devices may be placeholders).
        `shared`: a `PlanningMemo` whose stage traces and plans by program this call shares.

        Returns:
          (plans, transfers, once): transfers are `(from stage, to stage, bytes per receiving device,
          float)` per value and microbatch (a float value's cotangent travels back as many bytes);
          `once[s]` names the mesh axes over which stage s reduces its gradients once per step (its
          data-parallel replicas, `stage_records.set_replicas`; empty where it reduces them per microbatch).
        """
        traces = StageGraphs(shared.stage_traces) if shared is not None else None
        graph, stages, needed_by, _, mb = self._layout(params, batch, traces)
        self._say_if_mixing(graph, params, batch, mb)
        once = tuple(tuple(st.layout.mesh.axis_names[a] for a in st.axes if st.layout.mesh.shape[a] > 1)
                     if st.replica is not None else () for st in stages)
        plans = self._stage_plans(stages, options, shared.stage_solved if shared is not None else None)
        transfers = []
        for st in stages:
            for t in st.outs + st.aux_out:
                for u in sorted(needed_by.get(t, ())):
                    if u > st.index:
                        lay = stages[u].layout
                        nbytes = shard_bytes(graph.tensors[t], stages[u].act[t], lay.mesh)
                        transfers.append((st.index, u, float(nbytes), is_float(graph.tensors[t].dtype)))
        return plans, tuple(transfers), once

    def _build(self, params: Any, batch: Any):
        graph, layout, needed_by, param_owner, mb = self._layout(params, batch)
        stages = []
        for st, plan in zip(layout, self._stage_plans(layout)):
            lay = st.layout
            jmesh = lay.mesh.to_jax_mesh(list(lay.devices))
            shard = lambda spec: named_sharding(spec, lay.mesh, jmesh)  # noqa: E731
            zero_shapes = [(graph.tensors[graph.inputs[k]].shape, graph.tensors[graph.inputs[k]].dtype)
                           for k in st.own]
            stages.append(build_programs(
                self.optimizer, st.sg, plan, st.index, lay, jmesh, st.ops, st.own,
                st.bl, st.acts_in, st.aux_in, st.outs, st.aux_out,
                tuple(shard(x) for x in st.p_spec), tuple(shard(x) for x in st.b_spec), zero_shapes,
                st.replica, st.stacks))
        act_spec = {}
        for st, info in zip(stages, layout):
            for t, spec in info.act.items():
                act_spec[(st.index, t)] = named_sharding(spec, st.layout.mesh, st.mesh)
        return graph, tuple(stages), act_spec, needed_by, param_owner, mb

    # ----- running --------------------------------------------------------------------------
    def __call__(self, state: Mapping[str, Any], batch: Any):
        """One train step on `state = {"params", "opt_state"}`; returns (new state, {"loss": mean loss})."""
        params, opt_state, loss = self.step(state["params"], state["opt_state"], batch)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    def _built_for(self, params: Any, batch: Any):
        sig = (jax.tree_util.tree_structure((params, batch)),
               tuple((np.shape(x), str(x.dtype)) for x in jax.tree_util.tree_leaves((params, batch))))
        if sig not in self._built:
            self._built[sig] = self._build(params, batch)
            stages, owner = self._built[sig][1], self._built[sig][4]
            self._state[sig] = state_layouts(self.optimizer, len(self.layouts), params, owner,
                                             {s: st.params for s, st in enumerate(stages) if st.layout.offload_optimizer})
        return self._built[sig] + (self._state[sig],)

    def lower(self, params: Any, opt_state: Any, batch: Any) -> tuple[StageLowered, ...]:
        """Every stage's programs lowered for these arguments (arrays or ShapeDtypeStructs), in
        pipeline order: a `StageLowered` per stage with its forward, backward and update
        `jax.stages.Lowered` (the backward for one cotangent per stage output)."""
        graph, stages, act_spec, needed_by, _, mb, held = self._built_for(params, batch)
        flat_params, treedef = jax.tree_util.tree_flatten(params)
        flat_batch = jax.tree_util.tree_leaves(batch)
        opt_trees, full_opt = opt_layouts(held, opt_state)

        def sds(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

        out = []
        for s, st in enumerate(stages):
            p = [sds(np.shape(flat_params[k]), flat_params[k].dtype, sh)
                 for k, sh in zip(st.params, st.param_shardings)]
            masters = [sds(x.shape, x.dtype, x.sharding.with_memory_kind("pinned_host")) if j in st.casts else x
                       for j, x in enumerate(p)]
            low = [sds(x.shape, jax.eval_shape(st.casts[j], masters[j]).dtype, x.sharding) if j in st.casts else x
                   for j, x in enumerate(p)]
            b = [sds((mb,) + tuple(np.shape(flat_batch[k])[1:]), flat_batch[k].dtype, sh)
                 for k, sh in zip(st.batch, st.batch_shardings)]
            a = [sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)]) for t in st.acts_in]
            aux = [sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)]) for t in st.aux_in]
            cts = [[sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)])] for t in st.outs]
            acc = p
            if st.replica is not None:  # gradients per data-parallel replica, float32
                acc = [sds((st.replica.ways,) + x.shape, jnp.float32, replica_sharding(x.sharding, st.replica.axes))
                       for x in p]
            fwd = st.fwd.lower(low, a, aux, b)
            if st.layout.recomputes_all:
                bwd = st.bwd.lower(low, a, aux, b, cts, acc)
            else:
                compiled = fwd.compile()
                shapes = jax.eval_shape(st.fwd, low, a, aux, b)[2]
                pull = jax.tree.map(lambda x, sh: sds(x.shape, x.dtype, sh), shapes, compiled.output_shardings[2])
                bwd = st.bwd.lower(pull, cts, acc)
            ptree, odef, okeys = opt_trees[s]
            pos = {k: j for j, k in enumerate(st.params)}
            masked = jax.tree_util.tree_unflatten(ptree, [masters[pos[k]] if k in pos else None
                                                          for k in range(ptree.num_leaves)])
            masked_acc = jax.tree_util.tree_unflatten(ptree, [acc[pos[k]] if k in pos else None
                                                              for k in range(ptree.num_leaves)])
            shard_of = opt_shardings(okeys, st, flat_params, treedef)
            o = jax.tree_util.tree_unflatten(odef, [sds(np.shape(full_opt[k]), full_opt[k].dtype,
                                                        shard_of(k, full_opt[k])) for k in okeys])
            streamed = () if not st.layout.offload_optimizer else tuple(
                (k, st.apply.lower(*args)) for k, _, args in parameter_groups(
                    ptree, st.params, masters, acc, dict(zip(okeys, jax.tree_util.tree_leaves(o))),
                    held.groups[s]))
            out.append(StageLowered(s, st.layout.devices, st.mesh, fwd, bwd, st.apply.lower(masked, o, masked_acc),
                                    st.plan, st.replica.axes if st.replica is not None else (),
                                    st.replica is not None and tuple(st.opt_shardings) != tuple(st.param_shardings),
                                    streamed))
        return tuple(out)

    def step(self, params: Any, opt_state: Any, batch: Any):
        """(params, opt_state, batch) -> (new params, new opt_state, mean loss)."""
        graph, stages, act_spec, needed_by, _, mb, held = self._built_for(params, batch)
        B = self.num_microbatches
        flat_params, treedef = jax.tree_util.tree_flatten(params)
        flat_batch = jax.tree_util.tree_leaves(batch)
        opt_trees, full_opt = opt_layouts(held, opt_state)

        # master parameters the stage keeps in host memory (`programs.master_casts`) stay there; the
        # microbatches read their cast copies, made one parameter at a time (one program each)
        p = [[_put(flat_params[k], sh.with_memory_kind("pinned_host") if j in st.casts else sh)
              for j, (k, sh) in enumerate(zip(st.params, st.param_shardings))] for st in stages]
        low = [[st.casts[j](x) if j in st.casts else x for j, x in enumerate(ps)] for st, ps in zip(stages, p)]
        mbatch = [[[_put(flat_batch[k][i * mb:(i + 1) * mb], sh)
                    for k, sh in zip(st.batch, st.batch_shardings)] for i in range(B)] for st in stages]
        run = _Run(graph, stages, act_spec, needed_by, low, mbatch, [None] * len(stages), len(stages) - 1,
                   _put(np.asarray(1.0 / B, graph.tensors[graph.outputs[0]].dtype),
                        jax.sharding.NamedSharding(stages[-1].mesh, jax.sharding.PartitionSpec())))
        for s, kind, i in self.order:
            if kind == "F":
                _forward(run, s, i)
            else:
                _backward(run, s, i, self._producer_stage)
        loss = run.losses[0]
        for x in run.losses[1:]:
            loss = loss + x
        loss = loss / B

        new_flat, new_opt = _updated(stages, opt_trees, full_opt, flat_params, treedef, p, run.acc,
                                     held.groups)
        opt_paths, opt_def = jax.tree_util.tree_flatten_with_path(opt_state)
        opt_out = jax.tree_util.tree_unflatten(opt_def, [new_opt.get(jax.tree_util.keystr(pth), x)
                                                          for pth, x in opt_paths])
        return jax.tree_util.tree_unflatten(treedef, new_flat), opt_out, loss

    @staticmethod
    def _producer_stage(stages, t: int) -> int:
        for st in stages:
            if t in st.outs or t in st.aux_out:
                return st.index
        raise AssertionError(f"tensor {t} has no producing stage")



@dataclasses.dataclass(frozen=True)
class _Run:
    """One step's tasks in flight: what the stages read and the values moving between them (the
    mailboxes and accumulators fill and empty as the schedule's tasks run)."""

    graph: Any
    stages: tuple
    act_spec: dict  # (stage, tensor) -> the sharding the stage receives the tensor in
    needed_by: dict  # tensor -> the stages that read it
    params: list  # per stage: its parameters on its mesh
    batches: list  # per stage and microbatch: its batch leaves
    acc: list  # per stage: its gradient accumulator (None until its first backward)
    last: int  # the last stage, whose first output is the loss
    seed: Any  # the loss's cotangent, 1/B, on the last stage
    inbox: dict = dataclasses.field(default_factory=dict)  # (stage, tensor, microbatch) -> value
    ctbox: dict = dataclasses.field(default_factory=lambda: defaultdict(list))  # (owner, tensor, mb) -> cotangents
    saved: dict = dataclasses.field(default_factory=dict)  # (stage, microbatch) -> what its backward reads
    fetched: set = dataclasses.field(default_factory=set)  # saved values of offloaded stages already back
    losses: list = dataclasses.field(default_factory=list)


def _in_memory(values: Any, kind: str) -> Any:
    """`values` (arrays) copied to memory `kind` of their devices ("pinned_host", "device"); an
    array with no shard on this process's devices stays a handle."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind))
                        if x.addressable_shards else x, values)


def _forward(run: _Run, s: int, i: int) -> None:
    """Stage s's forward of microbatch i: its outputs sent to the later stages that read them."""
    st = run.stages[s]
    a = [run.inbox.pop((s, t, i)) for t in st.acts_in]
    aux = [run.inbox.pop((s, t, i)) for t in st.aux_in]
    if st.layout.recomputes_all:
        outs, aux_out = st.fwd(run.params[s], a, aux, run.batches[s][i])
        run.saved[(s, i)] = (a, aux)
    else:
        outs, aux_out, pull = st.fwd(run.params[s], a, aux, run.batches[s][i])
        run.saved[(s, i)] = _in_memory(pull, "pinned_host") if st.layout.offload_activations else pull
    for t, v in list(zip(st.outs, outs)) + list(zip(st.aux_out, aux_out)):
        for u in run.needed_by.get(t, ()):
            if u > s:
                run.inbox[(u, t, i)] = _send(v, run.act_spec[(u, t)])
    if s == run.last:
        run.losses.append(outs[0])


def _backward(run: _Run, s: int, i: int, producer_stage: Callable[[Any, int], int]) -> None:
    """Stage s's backward of microbatch i: its gradients accumulated, its input cotangents sent back
    to the stages that made those inputs."""
    st, graph = run.stages[s], run.graph
    cts = []
    for t in st.outs:
        got = run.ctbox.pop((s, t, i), [])
        if s == run.last and t == graph.outputs[0]:
            got = got + [run.seed]
        if not got:
            got = [jnp.zeros(graph.tensors[t].shape, graph.tensors[t].dtype, device=run.act_spec[(s, t)])]
        cts.append(got)
    if run.acc[s] is None:
        run.acc[s] = st.zeros()
    if st.layout.recomputes_all:
        a, aux = run.saved.pop((s, i))
        run.acc[s], ga = st.bwd(run.params[s], a, aux, run.batches[s][i], cts, run.acc[s])
    else:
        res = run.saved.pop((s, i))
        if st.layout.offload_activations and (s, i) not in run.fetched:
            res = _in_memory(res, "device")
        run.fetched.discard((s, i))
        run.acc[s], ga = st.bwd(res, cts, run.acc[s])
        if st.layout.offload_activations:  # the stage's next backward's values start back now
            ahead = min((j for u, j in run.saved if u == s and j > i), default=None)
            if ahead is not None:
                run.saved[(s, ahead)] = _in_memory(run.saved[(s, ahead)], "device")
                run.fetched.add((s, ahead))
    for t, g in zip(st.acts_in, ga):
        owner = producer_stage(run.stages, t)
        run.ctbox[(owner, t, i)].append(_send(g, run.act_spec[(owner, t)]))


def _updated(stages, opt_trees, full_opt, flat_params, treedef, p, acc, groups: Mapping[int, Mapping]
             ) -> tuple[list, dict[str, Any]]:
    """Every stage's optimizer update of its own parameters: (the new flat parameters, the new
    optimizer state leaves by path). A stage whose optimizer state lives in host memory updates one
    parameter at a time (`groups[s]`: each one's state layout), one program each: a device runs
    them in order, so it holds one parameter's state copied in (and its new value going out) at a
    time, not the stage's whole state (`stage_cost.update_peak`)."""
    new_flat = list(flat_params)
    new_opt: dict[str, Any] = {}
    for s, st in enumerate(stages):
        ptree, odef, okeys = opt_trees[s]
        n = ptree.num_leaves
        pos = {k: j for j, k in enumerate(st.params)}
        mask = lambda xs: jax.tree_util.tree_unflatten(  # noqa: E731
            ptree, [xs[pos[k]] if k in pos else None for k in range(n)])
        shard_of = opt_shardings(okeys, st, flat_params, treedef)
        o = jax.tree_util.tree_unflatten(odef, [_put(full_opt[k], shard_of(k, full_opt[k]))
                                                for k in okeys])
        grads = acc[s] if acc[s] is not None else st.zeros()
        if st.layout.offload_optimizer:
            for k, gkeys, args in parameter_groups(ptree, st.params, p[s], grads, dict(zip(okeys, jax.tree_util.tree_leaves(o))),
                                                   groups[s]):
                new_p, new_o = st.apply(*args)
                new_flat[k] = jax.tree_util.tree_leaves(new_p)[0]
                for key, x in zip(gkeys, jax.tree_util.tree_leaves(new_o)):
                    new_opt.setdefault(key, x)
            continue
        new_p, new_o = st.apply(mask(p[s]), o, mask(grads))
        for k, x in zip(st.params, [x for x in jax.tree_util.tree_leaves(new_p)]):
            new_flat[k] = x
        for key, x in zip(okeys, jax.tree_util.tree_leaves(new_o)):
            new_opt.setdefault(key, x)
    return new_flat, new_opt
