"""The pipeline runtime: per-stage programs on submeshes, driven by a GPipe or 1F1B schedule.

    step = PipelinedStep.from_plan(loss_fn, optimizer, pipeline_plan)
    state, metrics = step(state, batch)           # state = {"params": ..., "opt_state": ...}

The user marker is the split of the train step into its two halves: `loss_fn(params, batch)`
(a scalar mean over the batch) and an optax optimizer, exactly the pieces
`planner.models.make_train_step(loss_fn, optimizer)` assembles (Alpa needed `alpa.grad` for the
same reason: an opaque train step does not say where the gradient is). Nothing else changes: the
step takes and returns the usual state pytree, and computes the same loss and update as
`make_train_step(loss_fn, optimizer)` on the whole batch.

How it runs:
  * `loss_fn` is traced at the microbatch size and its ops grouped into the planner's layers
    (`cluster_layers`: the model's repeated modules by name, else balanced clustering matched to
    the stages' layers by position); each stage owns the ops of its layers, the parameters it
    reads first, and the batch leaves it reads.
  * Stage s gets three `jax.jit` programs on its submesh (a `jax.sharding.Mesh` over its devices,
    inputs placed with its planned shardings): forward (returns its outputs and the residuals of
    `jax.vjp`, or nothing extra under remat), backward (cotangents in, gradient accumulator and
    input cotangents out), and the optimizer update of its own parameters.
  * Activations and cotangents move between submeshes with `jax.device_put` to the receiving
    stage's sharding. Tasks are dispatched in the schedule's order from one thread; JAX's
    asynchronous dispatch runs the submeshes concurrently.
  * Each microbatch's loss is seeded with cotangent 1/B, so the accumulated gradient is the
    gradient of the mean loss over the whole batch.

The optimizer must update each parameter from its own gradient and state (AdamW, SGD, ...; not
global-norm clipping): each stage runs it on its own parameters, with the optimizer state leaves
that mirror them and a copy of the shared ones (e.g. the step count).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from planner.errors import InvalidArgumentError
from planner.graph import Graph, Literal, trace
from planner.mesh import MeshSpec
from planner.sharding import Spec, is_valid, named_sharding, replicated
from planner.stages.clustering import cluster_layers
from planner.stages.schedule import dispatch_order, stage_tasks


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where and how one stage runs.

    Attributes:
      layers: names of the layers it runs (as `cluster_layers` names them: "pre", "blocks_3", ...).
      devices: its devices.
      mesh: the logical mesh over `devices`.
      specs: sharding of program inputs by pytree path (parameters and batch leaves; paths of the
        train step such as "[0]['params']['blocks_3']['mlp']['fc_in']['kernel']" or of `loss_fn`'s
        own arguments); missing leaves: parameters replicated, batch leaves split over the whole
        mesh along axis 0 where it divides.
      remat: recompute the forward in the backward instead of keeping activations.
    """

    layers: tuple[str, ...]
    devices: tuple[Any, ...]
    mesh: MeshSpec
    specs: Mapping[str, Spec] = dataclasses.field(default_factory=dict)
    remat: bool = False

    def __post_init__(self):
        if len(self.devices) != self.mesh.size:
            raise InvalidArgumentError(
                f"stage mesh {self.mesh} needs {self.mesh.size} devices but {len(self.devices)} were given")


def layer_names(loss_fn: Callable[..., Any], params: Any, batch: Any) -> tuple[str, ...]:
    """The layers `PipelinedStep` splits `loss_fn` into (to build stage layouts by hand)."""
    return cluster_layers(trace(loss_fn, params, batch)).names


def even_layouts(names: Sequence[str], devices: Sequence[Any], num_stages: int) -> tuple[StageLayout, ...]:
    """`num_stages` stages of consecutive layers (as even as possible), each on an equal slice of
    `devices` as a 1-D mesh: a simple layout for tests and manual use."""
    if not 1 <= num_stages <= len(names):
        raise InvalidArgumentError(f"num_stages={num_stages} must be between 1 and the {len(names)} layers")
    if len(devices) % num_stages:
        raise InvalidArgumentError(f"{len(devices)} devices do not split evenly into {num_stages} stages")
    per = len(devices) // num_stages
    cuts = np.linspace(0, len(names), num_stages + 1).round().astype(int)
    return tuple(StageLayout(tuple(names[cuts[s]:cuts[s + 1]]), tuple(devices[s * per:(s + 1) * per]),
                             MeshSpec((per,), ("x",))) for s in range(num_stages))


@dataclasses.dataclass(frozen=True)
class _Stage:
    """The compiled pieces of one stage (built once per argument signature)."""

    index: int
    layout: StageLayout
    mesh: jax.sharding.Mesh
    ops: tuple[int, ...]
    params: tuple[int, ...]        # flat param leaves it owns
    batch: tuple[int, ...]         # flat batch leaves it reads
    acts_in: tuple[int, ...]       # float tensors received from earlier stages
    aux_in: tuple[int, ...]        # non-float tensors received (no cotangent)
    outs: tuple[int, ...]          # float tensors later stages (or the loss) need
    aux_out: tuple[int, ...]       # non-float tensors later stages need
    param_shardings: tuple[Any, ...]
    batch_shardings: tuple[Any, ...]
    fwd: Any
    bwd: Any
    zeros: Any
    apply: Any


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _find_spec(specs: Mapping[str, Spec], path: str, shape: tuple[int, ...], mesh: MeshSpec) -> Spec | None:
    """The spec of a leaf from a mapping keyed by train-step or loss-function paths (suffix match)."""
    best = None
    for key, spec in specs.items():
        if key == path or (key.endswith(path) and "opt_state" not in key):
            if len(spec) == len(shape) and is_valid(shape, spec, mesh):
                if key == path or key.endswith("['params']" + path):
                    return spec
                best = best or spec
    return best


def _data_spec(shape: tuple[int, ...], axes: tuple[int, ...], mesh: MeshSpec) -> Spec:
    if shape and axes and shape[0] % mesh.axis_size(axes) == 0:
        return (axes,) + ((),) * (len(shape) - 1)
    return replicated(len(shape))


class PipelinedStep:
    """A train step run as a pipeline (see the module docstring).

    Args:
      loss_fn: (params, batch) -> scalar mean loss.
      optimizer: an optax GradientTransformation that updates each parameter on its own.
      stages: the stage layouts, in pipeline order.
      num_microbatches: B; the batch size must be a multiple of it.
      schedule: "1f1b" or "gpipe".
    """

    def __init__(self, loss_fn: Callable[..., Any], optimizer: Any, stages: Sequence[StageLayout],
                 num_microbatches: int, schedule: str = "1f1b"):
        if not stages:
            raise InvalidArgumentError("a pipeline needs at least one stage")
        if not (isinstance(num_microbatches, int) and num_microbatches >= 1):
            raise InvalidArgumentError(f"num_microbatches={num_microbatches!r} must be an int >= 1")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.layouts = tuple(stages)
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.tasks = stage_tasks(schedule, len(self.layouts), num_microbatches)
        self.order = dispatch_order(self.tasks)
        self._built: dict[tuple, tuple] = {}

    def with_schedule(self, schedule: str) -> PipelinedStep:
        """The same stages and compiled programs under another schedule."""
        other = PipelinedStep(self.loss_fn, self.optimizer, self.layouts, self.num_microbatches, schedule)
        other._built = self._built
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
                                  dict(st.specs), st.remat) for st in plan.stages]
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
                                          specs, bool(st.get("remat", False))))
        return cls(loss_fn, optimizer, stages, B, schedule)

    # ----- building ------------------------------------------------------------------------
    def _build(self, params: Any, batch: Any):
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
        named = [name for lay in self.layouts for name in lay.layers]
        layers = cluster_layers(graph, num_layers=len(named))
        stage_of_layer = {}
        for s, lay in enumerate(self.layouts):
            for name in lay.layers:
                stage_of_layer[name] = s
        if layers.method == "flops" and len(named) == layers.num_layers and set(named) != set(layers.names):
            # Balanced clustering names layers by op ranges of the graph it ran on; match by position.
            stage_of_layer = {new: stage_of_layer[old] for new, old in zip(layers.names, named)}
        missing = [n for n in layers.names if n not in stage_of_layer]
        if missing:
            raise InvalidArgumentError(
                f"layers {missing} of loss_fn belong to no stage; the stages name {sorted(stage_of_layer)} "
                f"(loss_fn's layers are {list(layers.names)})")
        op_stage = [stage_of_layer[layers.names[l]] for l in layers.op_layer]
        n_params = len(jax.tree_util.tree_leaves(params))
        producer: dict[int, int] = {}
        param_owner: dict[int, int] = {}
        for k, t in enumerate(graph.inputs[:n_params]):
            users = [op_stage[op.index] for op in graph.ops if t in op.tensor_inputs]
            param_owner[k] = min(users) if users else stage_of_layer[layers.names[layers.input_layer[k]]]
            producer[t] = param_owner[k]
        for op in graph.ops:
            for t in op.tensor_inputs:
                src = producer.get(t)
                if src is not None and src > op_stage[op.index]:
                    raise InvalidArgumentError(
                        f"op {op.name} ({op.name_stack}) on stage {op_stage[op.index]} reads a value made on later "
                        f"stage {src}; stages must follow the program order of the layers")
            for t in op.outputs:
                producer[t] = op_stage[op.index]
        loss = graph.outputs[0]
        if producer.get(loss) != len(self.layouts) - 1:
            raise InvalidArgumentError("the loss must be computed on the last stage")
        batch_ids = set(graph.inputs[n_params:])
        needed_by: dict[int, set[int]] = defaultdict(set)
        for op in graph.ops:
            for t in op.tensor_inputs:
                if t in producer and producer[t] != op_stage[op.index] and t not in batch_ids:
                    needed_by[t].add(op_stage[op.index])
        param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        batch_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
        stages = []
        for s, lay in enumerate(self.layouts):
            jmesh = lay.mesh.to_jax_mesh(list(lay.devices))
            ops = tuple(op.index for op in graph.ops if op_stage[op.index] == s)
            own = tuple(k for k in range(n_params) if param_owner[k] == s)
            reads = {t for i in ops for t in graph.ops[i].tensor_inputs}
            bl = tuple(k for k, t in enumerate(graph.inputs[n_params:]) if t in reads)
            incoming = sorted(t for t in reads if t in producer and producer[t] < s and t not in batch_ids)
            made = {t for i in ops for t in graph.ops[i].outputs} | {graph.inputs[k] for k in own}
            outgoing = sorted(t for t in made if any(u > s for u in needed_by.get(t, ())))
            if s == len(self.layouts) - 1:
                outgoing = [loss] + [t for t in outgoing if t != loss]
            fl = lambda ts: tuple(t for t in ts if _is_float(graph.tensors[t].dtype))  # noqa: E731
            nf = lambda ts: tuple(t for t in ts if not _is_float(graph.tensors[t].dtype))  # noqa: E731
            data_axes = self._data_axes(lay, batch_paths, abstract_mb)
            p_shard = []
            for k in own:
                shape = tuple(np.shape(jax.tree_util.tree_leaves(params)[k]))
                spec = _find_spec(lay.specs, param_paths[k], shape, lay.mesh) or replicated(len(shape))
                p_shard.append(named_sharding(spec, lay.mesh, jmesh))
            b_shard = []
            for k in bl:
                shape = tuple(jax.tree_util.tree_leaves(abstract_mb)[k].shape)
                spec = _find_spec(lay.specs, batch_paths[k], shape, lay.mesh) or _data_spec(shape, data_axes, lay.mesh)
                b_shard.append(named_sharding(spec, lay.mesh, jmesh))
            st = self._programs(graph, s, lay, jmesh, ops, own, bl, n_params, fl(incoming), nf(incoming),
                                fl(outgoing), nf(outgoing), tuple(p_shard), tuple(b_shard))
            stages.append(st)
        act_spec = {}
        for st in stages:
            axes = self._data_axes(st.layout, batch_paths, abstract_mb)
            for t in st.acts_in + st.aux_in + st.outs + st.aux_out:
                act_spec[(st.index, t)] = named_sharding(
                    _data_spec(graph.tensors[t].shape, axes, st.layout.mesh), st.layout.mesh, st.mesh)
        return graph, tuple(stages), act_spec, needed_by, param_owner, mb

    @staticmethod
    def _data_axes(lay: StageLayout, batch_paths: Sequence[str], abstract_mb) -> tuple[int, ...]:
        """Mesh axes that split the batch on this stage (from its batch specs; all axes by default)."""
        for path, leaf in zip(batch_paths, jax.tree_util.tree_leaves(abstract_mb)):
            spec = _find_spec(lay.specs, path, tuple(leaf.shape), lay.mesh)
            if spec is not None:
                return spec[0] if spec else ()
        return tuple(range(lay.mesh.ndim))

    def _programs(self, graph: Graph, s: int, lay: StageLayout, jmesh, ops, own, bl, n_params,
                  acts_in, aux_in, outs, aux_out, p_shard, b_shard) -> _Stage:
        param_ids = tuple(graph.inputs[k] for k in own)
        batch_ids = tuple(graph.inputs[n_params + k] for k in bl)
        consts = dict(graph.consts)

        def run(p, a, aux, b):
            env: dict[int, Any] = dict(consts)
            env.update(zip(param_ids, p))
            env.update(zip(acts_in, a))
            env.update(zip(aux_in, aux))
            env.update(zip(batch_ids, b))

            def read(x):
                return x.value if isinstance(x, Literal) else env[x]

            for i in ops:
                op = graph.ops[i]
                res = op.primitive.bind(*(read(x) for x in op.inputs), **op.params)
                env.update(zip(op.outputs, res if op.primitive.multiple_results else [res]))
            return [env[t] for t in outs], [env[t] for t in aux_out]

        if lay.remat:
            def fwd(p, a, aux, b):
                return run(p, a, aux, b)

            def bwd(p, a, aux, b, cts, acc):
                _, pull, _ = jax.vjp(lambda p_, a_: run(p_, a_, aux, b), p, a, has_aux=True)
                gp, ga = pull([sum(c) for c in cts])
                return [x + y for x, y in zip(acc, gp)], ga
        else:
            def fwd(p, a, aux, b):
                o, pull, x = jax.vjp(lambda p_, a_: run(p_, a_, aux, b), p, a, has_aux=True)
                return o, x, pull

            def bwd(pull, cts, acc):
                gp, ga = pull([sum(c) for c in cts])
                return [x + y for x, y in zip(acc, gp)], ga

        def zeros():
            return [jnp.zeros(graph.tensors[t].shape, graph.tensors[t].dtype) for t in param_ids]

        optimizer = self.optimizer

        def apply(p, o, g):
            updates, o2 = optimizer.update(g, o, p)
            return optax.apply_updates(p, updates), o2

        nacc = 5 if lay.remat else 2
        return _Stage(
            index=s, layout=lay, mesh=jmesh, ops=ops, params=own, batch=bl, acts_in=acts_in, aux_in=aux_in,
            outs=outs, aux_out=aux_out, param_shardings=p_shard, batch_shardings=b_shard,
            fwd=jax.jit(fwd),
            bwd=jax.jit(bwd, out_shardings=(list(p_shard), None), donate_argnums=(nacc,)),
            zeros=jax.jit(zeros, out_shardings=list(p_shard)),
            apply=jax.jit(apply),
        )

    def _opt_layouts(self, params, opt_state, param_owner):
        """Per stage: the optimizer-state pytree of its parameters, built from the full state by path."""
        treedef = jax.tree_util.tree_structure(params)
        full = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]}
        n = treedef.num_leaves
        out = []
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        for s in range(len(self.layouts)):
            flat = jax.tree_util.tree_leaves(abstract)
            masked = jax.tree_util.tree_unflatten(treedef, [flat[k] if param_owner[k] == s else None
                                                            for k in range(n)])
            shape = jax.eval_shape(self.optimizer.init, masked)
            paths, tdef = jax.tree_util.tree_flatten_with_path(shape)
            keys = [jax.tree_util.keystr(p) for p, _ in paths]
            unknown = [k for k in keys if k not in full]
            if unknown:
                raise InvalidArgumentError(
                    f"optimizer state leaves {unknown[:3]} of stage {s} have no counterpart in the full optimizer "
                    "state; the pipeline needs an optimizer that updates each parameter on its own")
            out.append((treedef, tdef, keys))
        return out, full

    # ----- running --------------------------------------------------------------------------
    def __call__(self, state: Mapping[str, Any], batch: Any):
        """One train step on `state = {"params", "opt_state"}`; returns (new state, {"loss": mean loss})."""
        params, opt_state, loss = self.step(state["params"], state["opt_state"], batch)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    def step(self, params: Any, opt_state: Any, batch: Any):
        """(params, opt_state, batch) -> (new params, new opt_state, mean loss)."""
        sig = (jax.tree_util.tree_structure((params, batch)),
               tuple((np.shape(x), str(x.dtype)) for x in jax.tree_util.tree_leaves((params, batch))))
        if sig not in self._built:
            self._built[sig] = self._build(params, batch)
        graph, stages, act_spec, needed_by, param_owner, mb = self._built[sig]
        B = self.num_microbatches
        flat_params, treedef = jax.tree_util.tree_flatten(params)
        flat_batch = jax.tree_util.tree_leaves(batch)
        opt_layouts, full_opt = self._opt_layouts(params, opt_state, param_owner)

        p = [[jax.device_put(flat_params[k], sh) for k, sh in zip(st.params, st.param_shardings)] for st in stages]
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
            ptree, odef, okeys = opt_layouts[s]
            n = ptree.num_leaves
            pos = {k: j for j, k in enumerate(st.params)}
            mask = lambda xs: jax.tree_util.tree_unflatten(  # noqa: E731
                ptree, [xs[pos[k]] if k in pos else None for k in range(n)])
            shard_of = self._opt_shardings(okeys, st, flat_params, treedef)
            o = jax.tree_util.tree_unflatten(odef, [jax.device_put(full_opt[k], shard_of(k, full_opt[k]))
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

    def _opt_shardings(self, okeys, st: _Stage, flat_params, treedef):
        """Optimizer-state leaves take the sharding of the parameter they mirror; the rest are replicated."""
        paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(treedef, flat_params))[0]]
        mine = [(paths[k], np.shape(flat_params[k]), sh) for k, sh in zip(st.params, st.param_shardings)]
        rep = jax.sharding.NamedSharding(st.mesh, jax.sharding.PartitionSpec())

        def shard_of(key: str, leaf) -> Any:
            for path, shape, sh in mine:
                if key.endswith(path) and np.shape(leaf) == shape:
                    return sh
            return rep

        return shard_of
