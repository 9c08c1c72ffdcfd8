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
    under remat) and backward (cotangents in, gradient accumulator and input cotangents out), the
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
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from planner.graph.batch_mixing import mixing_ops, summary
from planner.core.errors import InvalidArgumentError, MeshError, PlannerError, first_line
from planner.graph.trace import trace
from planner.ilp.strategies import shard_bytes
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.plan import Plan, Prediction
from planner.search.mesh_plan import make_plan
from planner.core.sharding import named_sharding, replicated, spec_axes
from planner.emit.pipeline.layout import StageLayout, data_axes, data_spec, even_layouts, find_spec, layer_names
from planner.emit.pipeline.opt_state import opt_layouts, opt_shardings
from planner.emit.pipeline.partition import partition
from planner.emit.pipeline.programs import Replica, build_programs, replica_sharding, stage_graph
from planner.stages.derived import is_float
from planner.stages.schedule import dispatch_order, stage_tasks

log = logging.getLogger("planner")


def _put(x: Any, sharding: Any) -> Any:
    """`x` with `sharding`: itself when it has it already (the parameters and optimizer state a
    step handed back), else a `jax.device_put` (host time per leaf even when nothing moves)."""
    return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)


def _axis_indices(mesh: MeshSpec, names) -> tuple[int, ...]:
    """Positions in `mesh` of the axis `names` a plan records (`StagePlan.data_axes`)."""
    return tuple(sorted(mesh.axis_names.index(a) for a in names))

__all__ = ["PipelinedStep", "StageLayout", "StageLowered", "even_layouts", "layer_names"]


@dataclasses.dataclass(frozen=True)
class StageLowered:
    """One stage's lowered programs (`PipelinedStep.lower`, `.lower()` of a pipelined plan).

    Attributes:
      index: the stage's position in the pipeline.
      devices: its devices; mesh: the `jax.sharding.Mesh` its programs run on.
      forward: one microbatch's forward (outputs and the residuals the backward needs).
      backward: one microbatch's backward (gradient accumulation and input cotangents).
      update: the optimizer update of the stage's parameters.
      plan: the stage's intra-op `Plan` of one microbatch's forward + backward (its prediction
        lists the collectives the forward and backward together should compile to).
      data_axes: mesh axes over which the stage accumulates gradients per replica, reducing them in
        its update once per step (`programs.Replica`); empty: the backward reduces them.
    """

    index: int
    devices: tuple[Any, ...]
    mesh: Any
    forward: Any
    backward: Any
    update: Any
    plan: Any = None
    data_axes: tuple[str, ...] = ()

    def programs(self) -> dict[str, Any]:
        return {"forward": self.forward, "backward": self.backward, "update": self.update}


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
        self._mixing_said = False

    def with_schedule(self, schedule: str) -> PipelinedStep:
        """The same stages and compiled programs under another schedule."""
        other = PipelinedStep(self.loss_fn, self.optimizer, self.layouts, self.num_microbatches, schedule,
                              self.stage_plans, self.replica_grads)
        other._built, other._mixing_said = self._built, self._mixing_said
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
                                  dict(st.specs), st.remat, _axis_indices(st.mesh, st.data_axes))
                      for st in plan.stages]
        else:
            info = getattr(plan, "pipeline", None) or {}
            if not plan.stages or "devices" not in plan.stages[0]:
                raise InvalidArgumentError("this plan has no pipeline stages; plan with pipeline=True or 'auto'")
            B, schedule = int(info.get("num_microbatches", 1)), info.get("schedule", "1f1b")
            stages = []
            for st in plan.stages:
                mesh = MeshSpec(tuple(int(v) for v in st["mesh"].values()), tuple(st["mesh"]))
                names = list(mesh.axis_names)
                specs = {p: tuple(() if a is None else tuple(names.index(x) for x in a) for a in spec)
                         for p, spec in st.get("shardings", {}).items()}
                stages.append(StageLayout(tuple(st["layers"]), tuple(devices[i] for i in st["devices"]), mesh,
                                          specs, bool(st.get("remat", False)),
                                          _axis_indices(mesh, st["data_axes"]) if "data_axes" in st else None))
            plans = [Plan.from_json(json.dumps(plain_record(st["plan"]))) if st.get("plan") else None
                     for st in plan.stages]
            return cls(loss_fn, optimizer, stages, B, schedule, plans)
        return cls(loss_fn, optimizer, stages, B, schedule)

    # ----- building ------------------------------------------------------------------------
    def _layout(self, params: Any, batch: Any):
        """What each stage runs, devices aside: per stage its op, parameter, batch and boundary
        tensors, the specs of its inputs, and its `StageGraph` (forward + backward per microbatch)."""
        B = self.num_microbatches
        leaves = jax.tree_util.tree_leaves(batch)
        size = int(np.shape(leaves[0])[0]) if leaves else 0
        if not leaves or any(np.ndim(x) < 1 or np.shape(x)[0] != size for x in leaves) or size % B:
            raise InvalidArgumentError(
                f"every batch leaf must have a leading dimension divisible by num_microbatches={B}; "
                f"got shapes {[np.shape(x) for x in leaves]}")
        mb = size // B
        abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        abstract_mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb,) + tuple(np.shape(x)[1:]), x.dtype), batch)
        graph = trace(self.loss_fn, abstract_params, abstract_mb)
        if len(graph.outputs) != 1 or not isinstance(graph.outputs[0], int) or graph.tensors[graph.outputs[0]].shape:
            raise InvalidArgumentError("loss_fn must return one scalar (the mean loss over the batch)")
        n_params = len(jax.tree_util.tree_leaves(params))
        parts = partition(graph, self.layouts, n_params)
        op_stage, param_owner, producer, needed_by = parts.op_stage, parts.param_owner, parts.producer, parts.needed_by
        loss = graph.outputs[0]
        batch_ids = set(graph.inputs[n_params:])
        param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        batch_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
        flat_params = jax.tree_util.tree_leaves(params)
        flat_mb = jax.tree_util.tree_leaves(abstract_mb)
        stages = []
        op_inputs = parts.reads
        for s, lay in enumerate(self.layouts):
            ops = tuple(op.index for op in graph.ops if op_stage[op.index] == s)
            own = tuple(k for k in range(n_params) if param_owner[k] == s)
            reads = {t for i in ops for t in op_inputs[i]}
            bl = tuple(k for k, t in enumerate(graph.inputs[n_params:]) if t in reads)
            incoming = sorted(t for t in reads if t in producer and producer[t] < s and t not in batch_ids)
            made = {t for i in ops for t in graph.ops[i].outputs} | {graph.inputs[k] for k in own}
            outgoing = sorted(t for t in made if any(u > s for u in needed_by.get(t, ())))
            if s == len(self.layouts) - 1:
                outgoing = [loss] + [t for t in outgoing if t != loss]
            fl = lambda ts: tuple(t for t in ts if is_float(graph.tensors[t].dtype))  # noqa: E731
            nf = lambda ts: tuple(t for t in ts if not is_float(graph.tensors[t].dtype))  # noqa: E731
            axes = data_axes(lay, batch_paths, abstract_mb)
            p_spec = []
            for k in own:
                shape = tuple(np.shape(flat_params[k]))
                p_spec.append(find_spec(lay.specs, param_paths[k], shape, lay.mesh) or replicated(len(shape)))
            b_spec = []
            for k in bl:
                shape = tuple(flat_mb[k].shape)
                b_spec.append(find_spec(lay.specs, batch_paths[k], shape, lay.mesh) or data_spec(shape, axes, lay.mesh))
            act = {t: data_spec(graph.tensors[t].shape, axes, lay.mesh) for t in incoming + outgoing}
            acts_in, aux_in, outs, aux_out = fl(incoming), nf(incoming), fl(outgoing), nf(outgoing)
            sg = stage_graph(graph, ops, tuple(graph.inputs[k] for k in own),
                             acts_in, aux_in, tuple(graph.inputs[n_params + k] for k in bl), outs, aux_out)
            stages.append(dict(index=s, layout=lay, ops=ops, own=own, bl=bl, acts_in=acts_in, aux_in=aux_in,
                               outs=outs, aux_out=aux_out, p_spec=tuple(p_spec), b_spec=tuple(b_spec), act=act,
                               sg=sg, axes=axes, replica=None))
        if self.replica_grads:
            self._replicas(graph, stages, abstract_params, batch, mb, loss)
        return graph, stages, needed_by, param_owner, mb

    def _say_if_mixing(self, graph, n_params: int, mb: int) -> None:
        """Logs once, when the stages are planned, that the loss mixes the examples of its batch
        (`batch_mixing`): the pipelined step then legitimately differs from the plain one."""
        if self.num_microbatches < 2 or self._mixing_said:
            return
        self._mixing_said = True
        found = mixing_ops(graph, graph.inputs[n_params:], graph.outputs[0])
        if found:
            log.warning("loss_fn is not microbatch-invariant: %s; the pipeline computes it on each of %d "
                        "microbatches of %d examples and averages, so its loss and gradients differ from the "
                        "unpipelined step's", summary(found), self.num_microbatches, mb)

    def _replicas(self, graph, stages: list[dict], abstract_params: Any, batch: Any, mb: int, loss: int) -> None:
        """Sets each data-parallel stage's `programs.Replica` (its program traced at `mb / ways` rows)
        where every value it exchanges is batch-major or the loss and no parameter is split over a
        data axis; the other stages keep reducing gradients per microbatch."""
        traced: dict[int, Any] = {}
        for st in stages:
            lay, axes = st["layout"], tuple(a for a in st["axes"] if st["layout"].mesh.shape[a] > 1)
            ways = lay.mesh.axis_size(axes) if axes else 1
            if ways <= 1 or mb % ways or any(set(axes) & spec_axes(sp) for sp in st["p_spec"]):
                continue
            if ways not in traced:
                small = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb // ways,) + tuple(np.shape(x)[1:]), x.dtype),
                                     batch)
                try:
                    g = trace(self.loss_fn, abstract_params, small)
                except PlannerError:
                    raise
                except Exception as e:  # the user's step on fewer rows (an MoE's routing groups): not ours to fix
                    log.warning("the loss does not trace on one of %d data-parallel replicas' share of a microbatch "
                                "(%d of %d rows: %s: %s); stages split %d ways reduce their gradients every "
                                "microbatch instead of once per step", ways, mb // ways, mb, type(e).__name__,
                                first_line(e), ways)
                    g = None
                same = g is not None and len(g.ops) == len(graph.ops) and all(
                    a.name == b.name and a.outputs == b.outputs for a, b in zip(g.ops, graph.ops))
                traced[ways] = g if same else None
            g = traced[ways]
            if g is None:
                continue

            def kind(t, output=False):
                full, small = graph.tensors[t].shape, g.tensors[t].shape
                if full and small and small[0] * ways == full[0] and small[1:] == full[1:]:
                    return "batch"
                if full == small and (not output or t == loss):
                    return "mean" if output else "same"
                return None

            ins = {"a": [kind(t) for t in st["acts_in"]], "aux": [kind(t) for t in st["aux_in"]],
                   "b": [kind(g.inputs[len(g.inputs) - len(jax.tree_util.tree_leaves(batch)) + k]) for k in st["bl"]]}
            outs = {"ct": [kind(t, True) for t in st["outs"]], "aux_out": [kind(t, True) for t in st["aux_out"]]}
            if any(k is None for ks in list(ins.values()) + list(outs.values()) for k in ks) or \
                    "mean" in outs["aux_out"]:
                continue
            sg = stage_graph(g, st["ops"], tuple(g.inputs[k] for k in st["own"]), st["acts_in"], st["aux_in"],
                             tuple(g.inputs[len(g.inputs) - len(jax.tree_util.tree_leaves(batch)) + k]
                                   for k in st["bl"]), st["outs"], st["aux_out"])
            full = st["sg"]
            planned = len(sg.graph.ops) == len(full.graph.ops) and sg.split == full.split and all(
                x.name == y.name for x, y in zip(sg.graph.ops, full.graph.ops))
            if sg.split is None and not lay.remat:
                continue
            names = lay.mesh.axis_names
            st["replica"] = Replica(tuple(names[a] for a in axes), ways, sg,
                                    {k: tuple(v) for k, v in ins.items()}, {k: tuple(v) for k, v in outs.items()},
                                    planned)

    def _stage_plan(self, st: dict, options: Any = None):
        """The stage's intra-op `Plan` of its `StageGraph`: the one given (`stage_plans`, as a saved
        plan records it) when it was made for this program, else planned now with the stage's
        parameter, batch and boundary shardings pinned."""
        sg, lay, s = st["sg"], st["layout"], st["index"]
        given = self.stage_plans[s] if s < len(self.stage_plans) else None
        if given is not None:
            if given.solver.get("ops") != len(sg.graph.ops) or len(given.input_specs) != len(sg.graph.inputs) \
                    or given.mesh != lay.mesh:
                raise InvalidArgumentError(
                    f"stage {s}'s saved intra-op plan is for a program of {given.solver.get('ops')} ops on "
                    f"{given.mesh}, this step's stage has {len(sg.graph.ops)} ops on {lay.mesh}; re-plan")
            return given
        pins = {}
        for group, specs in (("p", st["p_spec"]), ("b", st["b_spec"]),
                             ("a", [st["act"][t] for t in st["acts_in"]]),
                             ("aux", [st["act"][t] for t in st["aux_in"]]),
                             ("ct", [st["act"][t] for t in st["outs"]])):
            pins.update(zip(sg.input_positions(group), specs))
        if isinstance(options, Sequence):
            options = options[s]
        opts = dataclasses.replace(options or PlanOptions(), memory_budget=None, pipeline=False, tie_outputs=True,
                                   donate_argnums=())  # a stage program's own inputs, not the step's arguments
        try:
            return make_plan(sg.graph, lay.mesh, opts, pins=pins)
        except MeshError:
            # No input of the stage can be split on its mesh (scalars, say): it runs replicated.
            g = sg.graph
            rank = [len(g.tensors[t].shape) if isinstance(t, int) else len(t.tensor.shape) for t in g.outputs]
            return Plan(mesh=lay.mesh, input_paths=g.input_paths,
                        input_specs=tuple(replicated(len(g.tensors[t].shape)) for t in g.inputs),
                        output_paths=g.output_paths, output_specs=tuple(replicated(r) for r in rank), op_specs=(),
                        prediction=Prediction(0.0, 0.0, 0.0, 0, 0.0, ()), decisions=(),
                        solver={"status": "replicated", "ops": len(g.ops)}, options=opts.to_json(),
                        in_tree=g.in_tree, out_tree=g.out_tree)

    def stage_plan_records(self, params: Any, batch: Any,
                           options: Any = None) -> tuple[tuple[Plan, ...], tuple, tuple[tuple[str, ...], ...]]:
        """Every stage's intra-op plan (`_stage_plan`; `options` one `PlanOptions` or one per stage)
        and the values crossing stages, without devices (layout devices may be placeholders).

        Returns:
          (plans, transfers, once): transfers are `(from stage, to stage, bytes per receiving device,
          float)` per value and microbatch (a float value's cotangent travels back as many bytes);
          `once[s]` names the mesh axes over which stage s reduces its gradients once per step (its
          data-parallel replicas, `_replicas`; empty where it reduces them per microbatch).
        """
        graph, stages, needed_by, _, mb = self._layout(params, batch)
        self._say_if_mixing(graph, len(jax.tree_util.tree_leaves(params)), mb)
        once = tuple(tuple(st["layout"].mesh.axis_names[a] for a in st["axes"] if st["layout"].mesh.shape[a] > 1)
                     if st["replica"] is not None else () for st in stages)
        plans = tuple(self._stage_plan(st, options) for st in stages)
        transfers = []
        for st in stages:
            for t in st["outs"] + st["aux_out"]:
                for u in sorted(needed_by.get(t, ())):
                    if u > st["index"]:
                        lay = stages[u]["layout"]
                        nbytes = shard_bytes(graph.tensors[t], stages[u]["act"][t], lay.mesh)
                        transfers.append((st["index"], u, float(nbytes), is_float(graph.tensors[t].dtype)))
        return plans, tuple(transfers), once

    def _build(self, params: Any, batch: Any):
        graph, layout, needed_by, param_owner, mb = self._layout(params, batch)
        stages = []
        for st in layout:
            lay = st["layout"]
            jmesh = lay.mesh.to_jax_mesh(list(lay.devices))
            shard = lambda spec: named_sharding(spec, lay.mesh, jmesh)  # noqa: E731
            zero_shapes = [(graph.tensors[graph.inputs[k]].shape, graph.tensors[graph.inputs[k]].dtype)
                           for k in st["own"]]
            stages.append(build_programs(
                self.optimizer, st["sg"], self._stage_plan(st), st["index"], lay, jmesh, st["ops"], st["own"],
                st["bl"], st["acts_in"], st["aux_in"], st["outs"], st["aux_out"],
                tuple(shard(x) for x in st["p_spec"]), tuple(shard(x) for x in st["b_spec"]), zero_shapes,
                st["replica"]))
        act_spec = {}
        for st, info in zip(stages, layout):
            for t, spec in info["act"].items():
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
        return self._built[sig]

    def lower(self, params: Any, opt_state: Any, batch: Any) -> tuple[StageLowered, ...]:
        """Every stage's programs lowered for these arguments (arrays or ShapeDtypeStructs), in
        pipeline order: a `StageLowered` per stage with its forward, backward and update
        `jax.stages.Lowered` (the backward for one cotangent per stage output)."""
        graph, stages, act_spec, needed_by, param_owner, mb = self._built_for(params, batch)
        flat_params, treedef = jax.tree_util.tree_flatten(params)
        flat_batch = jax.tree_util.tree_leaves(batch)
        opt_trees, full_opt = opt_layouts(self.optimizer, len(self.layouts), params, opt_state, param_owner)

        def sds(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

        out = []
        for s, st in enumerate(stages):
            p = [sds(np.shape(flat_params[k]), flat_params[k].dtype, sh)
                 for k, sh in zip(st.params, st.param_shardings)]
            b = [sds((mb,) + tuple(np.shape(flat_batch[k])[1:]), flat_batch[k].dtype, sh)
                 for k, sh in zip(st.batch, st.batch_shardings)]
            a = [sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)]) for t in st.acts_in]
            aux = [sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)]) for t in st.aux_in]
            cts = [[sds(graph.tensors[t].shape, graph.tensors[t].dtype, act_spec[(s, t)])] for t in st.outs]
            acc = p
            if st.replica is not None:  # gradients per data-parallel replica, float32
                acc = [sds((st.replica.ways,) + x.shape, jnp.float32, replica_sharding(x.sharding, st.replica.axes))
                       for x in p]
            fwd = st.fwd.lower(p, a, aux, b)
            if st.layout.remat:
                bwd = st.bwd.lower(p, a, aux, b, cts, acc)
            else:
                compiled = fwd.compile()
                shapes = jax.eval_shape(st.fwd, p, a, aux, b)[2]
                pull = jax.tree.map(lambda x, sh: sds(x.shape, x.dtype, sh), shapes, compiled.output_shardings[2])
                bwd = st.bwd.lower(pull, cts, acc)
            ptree, odef, okeys = opt_trees[s]
            pos = {k: j for j, k in enumerate(st.params)}
            masked = jax.tree_util.tree_unflatten(ptree, [p[pos[k]] if k in pos else None
                                                          for k in range(ptree.num_leaves)])
            masked_acc = jax.tree_util.tree_unflatten(ptree, [acc[pos[k]] if k in pos else None
                                                              for k in range(ptree.num_leaves)])
            shard_of = opt_shardings(okeys, st, flat_params, treedef)
            o = jax.tree_util.tree_unflatten(odef, [sds(np.shape(full_opt[k]), full_opt[k].dtype,
                                                        shard_of(k, full_opt[k])) for k in okeys])
            out.append(StageLowered(s, st.layout.devices, st.mesh, fwd, bwd, st.apply.lower(masked, o, masked_acc),
                                    st.plan, st.replica.axes if st.replica is not None else ()))
        return tuple(out)

    def step(self, params: Any, opt_state: Any, batch: Any):
        """(params, opt_state, batch) -> (new params, new opt_state, mean loss)."""
        graph, stages, act_spec, needed_by, param_owner, mb = self._built_for(params, batch)
        B = self.num_microbatches
        flat_params, treedef = jax.tree_util.tree_flatten(params)
        flat_batch = jax.tree_util.tree_leaves(batch)
        opt_trees, full_opt = opt_layouts(self.optimizer, len(self.layouts), params, opt_state, param_owner)

        p = [[_put(flat_params[k], sh) for k, sh in zip(st.params, st.param_shardings)] for st in stages]
        mbatch = [[[jax.device_put(flat_batch[k][i * mb:(i + 1) * mb], sh)
                    for k, sh in zip(st.batch, st.batch_shardings)] for i in range(B)] for st in stages]
        inbox: dict[tuple[int, int, int], Any] = {}      # (stage, tensor, microbatch) -> value
        ctbox: dict[tuple[int, int, int], list] = defaultdict(list)  # (owner stage, tensor, mb) -> cotangents
        saved: dict[tuple[int, int], Any] = {}
        acc = [None] * len(stages)
        losses = []
        last = len(stages) - 1
        seed = jax.device_put(jnp.asarray(1.0 / B, graph.tensors[graph.outputs[0]].dtype),
                              jax.sharding.NamedSharding(stages[last].mesh, jax.sharding.PartitionSpec()))
        for s, kind, i in self.order:
            st = stages[s]
            if kind == "F":
                a = [inbox.pop((s, t, i)) for t in st.acts_in]
                aux = [inbox.pop((s, t, i)) for t in st.aux_in]
                if st.layout.remat:
                    outs, aux_out = st.fwd(p[s], a, aux, mbatch[s][i])
                    saved[(s, i)] = (a, aux)
                else:
                    outs, aux_out, pull = st.fwd(p[s], a, aux, mbatch[s][i])
                    saved[(s, i)] = pull
                for t, v in list(zip(st.outs, outs)) + list(zip(st.aux_out, aux_out)):
                    for u in needed_by.get(t, ()):
                        if u > s:
                            inbox[(u, t, i)] = jax.device_put(v, act_spec[(u, t)])
                if s == last:
                    losses.append(outs[0])
            else:
                cts = []
                for t in st.outs:
                    got = ctbox.pop((s, t, i), [])
                    if s == last and t == graph.outputs[0]:
                        got = got + [seed]
                    if not got:
                        got = [jnp.zeros(graph.tensors[t].shape, graph.tensors[t].dtype, device=act_spec[(s, t)])]
                    cts.append(got)
                if acc[s] is None:
                    acc[s] = st.zeros()
                if st.layout.remat:
                    a, aux = saved.pop((s, i))
                    acc[s], ga = st.bwd(p[s], a, aux, mbatch[s][i], cts, acc[s])
                else:
                    acc[s], ga = st.bwd(saved.pop((s, i)), cts, acc[s])
                for t, g in zip(st.acts_in, ga):
                    owner = self._producer_stage(stages, t)
                    ctbox[(owner, t, i)].append(jax.device_put(g, act_spec[(owner, t)]))
        loss = losses[0]
        for x in losses[1:]:
            loss = loss + x
        loss = loss / B

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
            new_p, new_o = st.apply(mask(p[s]), o, mask(grads))
            for k, x in zip(st.params, [x for x in jax.tree_util.tree_leaves(new_p)]):
                new_flat[k] = x
            for key, x in zip(okeys, jax.tree_util.tree_leaves(new_o)):
                new_opt.setdefault(key, x)
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


def plain_record(value: Any) -> Any:
    """A plan record's read-only mappings and tuples as JSON dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_record(v) for v in value]
    return value
