"""The compiled programs of one pipeline stage: forward, backward, gradient zeros and update.

The stage's ops of the traced `loss_fn` (its layers, bound in program order) and their `jax.vjp`
are traced into one program per microbatch (`StageGraph`); the stage's intra-op plan is made for
that program, and the forward and backward are its two halves evaluated with the plan's sharding
constraints on every planned intermediate (as single-stage emission does), on the stage's submesh.

Gradient accumulation per data-parallel replica (`Replica`): when the stage's batch is split over
mesh axes (its data-parallel axes, `ways` replicas), the forward and backward run as `jax.vmap`
over the replicas (`spmd_axis_name` = those axes) of the same program traced at `microbatch /
ways` rows, under the plan with those axes taken out of its specs: each replica's parameter
gradient stays on its replica (no collective), the accumulator carries the replica axis (float32,
split over the data axes), and the update sums it once per step (one all-reduce, or a
reduce-scatter where the parameter is split) before the optimizer, as Megatron-LM does. This is
the unsharded step's arithmetic for a loss that is a mean of per-example terms (the runtime's
contract); only the order of the gradient sums changes.

A stage in the sharded-optimizer state layout (`StageLayout.shard_optimizer`, with replicas) keeps
the optimizer state of each parameter split over its data axes too (`core.sharding.optimizer_spec`,
the planner's rule): its update reduce-scatters each replica-accumulated gradient into that layout
(`jax.lax.psum_scatter`, in the wire format the plan priced), updates the parameter's shard, and
all-gathers the parameter back into the plan's layout (Megatron-LM's distributed optimizer). In
the offloaded-optimizer layout (`StageLayout.offload_optimizer`) that state lives in host memory
(`pinned_host`) between updates; the update copies it in and its new value back out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from planner.core.sharding import optimizer_spec
from planner.emit.wire import op_hooks, reduce_replicas, replica_wire, scatter_replicas
from planner.emit.single import constraint_hooks
from planner.core.errors import InvalidArgumentError
from planner.graph.ir import Graph, Literal
from planner.graph.trace import trace
from planner.emit.pipeline.layout import StageLayout
from planner.stages.derived import op_ranges
from planner.stages.layer_cost import narrow_casts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StagePrograms:
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
    plan: Any = None               # the stage's intra-op `Plan` of `stage_graph.graph`
    stage_graph: Any = None
    replica: Any = None            # `Replica` when gradients accumulate per data-parallel replica
    opt_shardings: tuple[Any, ...] = ()  # per owned parameter, its optimizer state's (() : the parameter's)
    casts: Any = None  # per owned parameter kept in host memory (`master_casts`), the program making its cast copy


@dataclasses.dataclass(frozen=True)
class Replica:
    """How a stage runs per data-parallel replica (see the module docstring).

    Attributes:
      axes: names of the mesh axes the replicas are split over (the stage's data axes, in order).
      ways: number of replicas (the product of those axes' sizes).
      sg: the stage's `StageGraph` traced at `microbatch / ways` rows (same ops as the full one).
      ins: per input group ("a", "aux", "b"), per value: "batch" (dim 0 is the batch: split over
        the replicas) or "same" (every replica reads it whole).
      outs: per output group ("ct", "aux_out"), per value: "batch" (concatenated back) or "mean"
        (the loss: the mean of the replicas' means).
      planned: `sg` has the full program's ops one for one, so the plan's intermediates are
        constrained in it too (its data axes taken out); False (tracing at fewer rows made other
        ops, e.g. for dimensions of size 1): only its inputs and outputs are placed, and the
        partitioner propagates from them.
    """

    axes: tuple[str, ...]
    ways: int
    sg: StageGraph
    ins: Mapping[str, tuple[str, ...]]
    outs: Mapping[str, tuple[str, ...]]
    planned: bool = True


def strip_axes(plan: Any, axes: tuple[int, ...]) -> Any:
    """`plan` with mesh `axes` taken out of every intermediate's spec (the replica program's plan:
    `jax.vmap(..., spmd_axis_name=...)` puts those axes on the replica dimension)."""
    drop = set(axes)

    def strip(spec):
        return tuple(tuple(a for a in dims if a not in drop) for dims in spec)

    return dataclasses.replace(
        plan, op_specs=tuple((i, k, strip(sp)) for i, k, sp in plan.op_specs),
        scatter_specs=tuple((i, k, strip(sp)) for i, k, sp in plan.scatter_specs),
        operand_specs=tuple((i, k, strip(sp)) for i, k, sp in plan.operand_specs),
        # an int8 gradient exchange over a replica axis is the runtime's once-per-step sum instead
        wire=tuple(w for w in plan.wire if not (w.kind == "reduce" and drop & set(w.axes))))


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """One stage's forward and backward of one microbatch as one traced program, the program its
    intra-op plan is made for and its jitted pieces run.

    `graph` maps `{"p": params, "a": float activations in, "aux": other values in, "b": batch
    leaves, "ct": cotangents of the float outputs}` to `{"ct": float outputs, "aux_out": other
    outputs, "p": parameter gradients, "a": activation cotangents}` (gradients and outputs carry
    the path of the input they mirror, so the plan ties their shardings to it). Ops [0, split) are
    the forward (they never read a cotangent), [split, n) the backward; `residuals` are the values
    the backward reads from the forward.
    """

    graph: Graph
    split: int | None              # None: the backward starts before the forward's outputs are made
    residuals: tuple[int, ...]
    inputs: Mapping[str, tuple[int, ...]]    # group -> input tensor ids
    outputs: Mapping[str, tuple[Any, ...]]   # group -> output tensor ids (or literals)

    def input_positions(self, group: str) -> tuple[int, ...]:
        pos = {t: i for i, t in enumerate(self.graph.inputs)}
        return tuple(pos[t] for t in self.inputs[group])

    def kept_residuals(self, cut: int) -> tuple[int, ...]:
        """What the backward reads from the forward when it first recomputes the forward's ops
        [0, cut) (`recompute_cut`): the values the recomputation and ops [split, n) read that
        neither makes (the stage's inputs among them), the cotangents and constants aside."""
        g, n = self.graph, len(self.graph.ops)
        run = [i for a, b in ((0, cut), (self.split, n)) for i in range(a, b)]
        made = {t for i in run for t in g.ops[i].outputs}
        reads = [t for i in run for t in g.ops[i].tensor_inputs]
        for regions in g.regions.values():
            reads += [t for r in regions if r.start >= self.split or r.start < cut
                      for t in r.operands if isinstance(t, int)]
        reads += [t for k in ("p", "a") for t in self.outputs[k] if isinstance(t, int)]
        cts = set(self.inputs["ct"])
        return tuple(dict.fromkeys(t for t in reads if t not in made and t not in cts and t not in g.consts))


def _stack(name: str) -> str:
    """An op's module path without the transformations the stage's trace wrapped it in ("jvp(blocks_3)")."""
    while True:
        plain = re.sub(r"jvp\(([^()]*)\)", r"\1", name)
        if plain == name:
            return name
        name = plain


def recompute_cut(sg: StageGraph, kept: frozenset[str], recomputed: frozenset[str]) -> int | None:
    """Where a stage that keeps its last layers' activations stops recomputing: the first forward op
    of `sg` (before `split`) bound under a module path only the kept layers' ops carry (`kept`: the
    name stacks of their ops in the traced `loss_fn`; `recomputed`: those of the layers before),
    moved back to the start of a region it falls in. Ops [0, cut) are recomputed in the backward,
    ops [cut, split) keep their residuals. None: no forward op names a kept layer only (then the
    whole forward is recomputed), or the forward cannot be cut from the backward."""
    if sg.split is None:
        return None
    only = kept - recomputed
    cut = next((op.index for op in sg.graph.ops[:sg.split] if _stack(op.name_stack) in only), None)
    if cut is None:
        return None
    changed = True
    while changed:  # a region runs whole on one side
        changed = False
        for regions in sg.graph.regions.values():
            for r in regions:
                if r.start < cut < r.end:
                    cut, changed = r.start, True
    return cut


@contextlib.contextmanager
def _named_ops():
    """`(before_op, after_op, scope)` hooks that bind each op under its traced module path
    (`jax.named_scope`), so the stage's program keeps the layer names its plan shares decisions
    by. The scope opened before an op closes right after it; region results (no scope of their
    own) pass through; a custom-derivative call is bound in its own scope (`scope`), so the ops
    its rule makes keep the layer's name; scopes still open on an error are closed."""
    opened: list[tuple[int, Any]] = []

    def before(op, operands):
        if op.name_stack:
            scope = jax.named_scope(op.name_stack)
            scope.__enter__()
            opened.append((op.index, scope))
        return operands

    def after(op, outs):
        if opened and opened[-1][0] == op.index:
            opened.pop()[1].__exit__(None, None, None)
        return outs

    def scope(region):
        return jax.named_scope(region.name_stack) if region.name_stack else contextlib.nullcontext()

    try:
        yield before, after, scope
    finally:
        while opened:
            opened.pop()[1].__exit__(None, None, None)


def stage_graph(graph: Graph, ops: tuple[int, ...], param_ids: tuple[int, ...], acts_in: tuple[int, ...],
                aux_in: tuple[int, ...], batch_ids: tuple[int, ...], outs: tuple[int, ...],
                aux_out: tuple[int, ...]) -> StageGraph:
    """Traces the stage's forward + backward (`jax.vjp` of its ops of `graph`) into a `StageGraph`."""
    consts = dict(graph.consts)
    ranges = op_ranges(ops)

    def run(p, a, aux, b):
        env: dict[int, Any] = dict(consts)
        env.update(zip(param_ids, p))
        env.update(zip(acts_in, a))
        env.update(zip(aux_in, aux))
        env.update(zip(batch_ids, b))
        with _named_ops() as (before, after, scope):
            for start, end in ranges:
                graph.run_range(start, end, env, before, after, scope)
        return [env[t] for t in outs], [env[t] for t in aux_out]

    def train(args):
        o, pull, x = jax.vjp(lambda p_, a_: run(p_, a_, args["aux"], args["b"]), args["p"], args["a"], has_aux=True)
        gp, ga = pull(args["ct"])
        return ({"ct": o, "aux_out": x, "p": gp, "a": ga},)  # paths as the inputs': "[0]['p'][0]"

    def sds(ts):
        return [jax.ShapeDtypeStruct(graph.tensors[t].shape, graph.tensors[t].dtype) for t in ts]

    groups = {"p": param_ids, "a": acts_in, "aux": aux_in, "b": batch_ids, "ct": outs}
    g = trace(train, {k: sds(v) for k, v in groups.items()})
    in_pos = jax.tree_util.tree_unflatten(g.in_tree, list(range(len(g.inputs))))[0]
    out_pos = jax.tree_util.tree_unflatten(g.out_tree, list(range(len(g.outputs))))[0]
    inputs = {k: tuple(g.inputs[i] for i in in_pos[k]) for k in groups}
    outputs = {k: tuple(g.outputs[i] for i in out_pos[k]) for k in ("ct", "aux_out", "p", "a")}
    cts = set(inputs["ct"])
    dep = set(cts)
    first_bwd = len(g.ops)
    for op in g.ops:
        if any(t in dep for t in op.tensor_inputs):
            dep.update(op.outputs)
            first_bwd = min(first_bwd, op.index)
    producers = g.producers()
    made = [producers[t][0] for t in outputs["ct"] + outputs["aux_out"] if isinstance(t, int) and t in producers]
    split = max(made, default=-1) + 1
    changed = True
    while changed:  # a control-flow region runs whole on one side
        changed = False
        for regions in g.regions.values():
            for r in regions:
                if r.start < split < r.end:
                    split, changed = r.end, True
    if split > first_bwd:  # no forward program can be cut from it; only a remat stage can run it
        return StageGraph(g, None, (), inputs, outputs)
    sg = StageGraph(g, split, (), inputs, outputs)
    return dataclasses.replace(sg, residuals=sg.kept_residuals(0))  # nothing recomputed


def _halves(sg: StageGraph, plan: Any, jmesh, remat: bool, cut: int | None = None):
    """(forward, backward) of one microbatch of `sg`, evaluated under `plan`'s constraints: the
    forward gives (outputs, aux outputs[, residuals]); the backward (residuals, or the forward's
    inputs under remat, then the summed output cotangents) gives (parameter gradients, input
    cotangents). With `cut` (not under `remat`) the residuals are `sg.kept_residuals(cut)` and the
    backward recomputes the forward's ops [0, cut) first."""
    g = sg.graph
    consts = dict(g.consts)
    before_op, after_op = constraint_hooks(plan, jmesh)
    before_op, on_shards = op_hooks(plan, jmesh, g, before_op)
    n = len(g.ops)
    residuals = sg.residuals if cut is None or remat else sg.kept_residuals(cut)

    def read(env, x):
        return x.value if isinstance(x, Literal) else env[x]

    def seeded(p, a, aux, b):
        env: dict[int, Any] = dict(consts)
        for k, vals in (("p", p), ("a", a), ("aux", aux), ("b", b)):
            env.update(zip(sg.inputs[k], vals))
        return env

    def grads(env):
        return [read(env, t) for t in sg.outputs["p"]], [read(env, t) for t in sg.outputs["a"]]

    def fwd(p, a, aux, b):
        env = seeded(p, a, aux, b)
        if sg.split is None:  # (remat only) forward and backward interleave: run both, on zero cotangents
            env.update((t, jnp.zeros(g.tensors[t].shape, g.tensors[t].dtype)) for t in sg.inputs["ct"])
        g.run_range(0, n if sg.split is None else sg.split, env, before_op, after_op, apply_op=on_shards)
        o = [read(env, t) for t in sg.outputs["ct"]]
        x = [read(env, t) for t in sg.outputs["aux_out"]]
        if remat:
            return o, x
        return o, x, [env.get(t) for t in residuals]

    if remat:
        def bwd(p, a, aux, b, cts):
            env = seeded(p, a, aux, b)
            env.update(zip(sg.inputs["ct"], cts))
            g.run_range(0, n, env, before_op, after_op, apply_op=on_shards)
            return grads(env)
    else:
        def bwd(res, cts):
            env: dict[int, Any] = dict(consts)
            env.update((t, v) for t, v in zip(residuals, res) if v is not None)
            if cut:  # the recomputed layers' forward
                g.run_range(0, cut, env, before_op, after_op, apply_op=on_shards)
            env.update(zip(sg.inputs["ct"], cts))
            g.run_range(sg.split, n, env, before_op, after_op, apply_op=on_shards)
            return grads(env)
    return fwd, bwd


def _replicated_halves(rep: Replica, plan: Any, jmesh, remat: bool, cut: int | None = None):
    """(forward, backward) over the whole microbatch as `jax.vmap` over the data-parallel replicas of
    the replica program's halves (`Replica`); the backward's parameter gradients keep the replica
    axis in front, its input cotangents and the forward's outputs are whole-microbatch values."""
    names = list(jmesh.axis_names)
    # a replica program that is not the full one op for one runs unconstrained: none of the plan's
    # per-op facts (its layouts, and its wire formats, keyed by the full program's op indices) apply
    local = strip_axes(plan, tuple(names.index(a) for a in rep.axes)) if rep.planned else \
        dataclasses.replace(plan, op_specs=(), scatter_specs=(), operand_specs=(), wire=())
    fwd1, bwd1 = _halves(rep.sg, local, jmesh, remat, cut)
    w = rep.ways
    spmd = rep.axes if len(rep.axes) > 1 else rep.axes[0]

    def split(xs, kinds):
        return [x.reshape((w, x.shape[0] // w) + x.shape[1:]) if k == "batch" else x for x, k in zip(xs, kinds)]

    def join(xs, kinds):
        return [x.reshape((-1,) + x.shape[2:]) if k == "batch" else jnp.mean(x, axis=0) for x, k in zip(xs, kinds)]

    def axes_of(kinds):
        return [0 if k == "batch" else None for k in kinds]

    ins = (None, axes_of(rep.ins["a"]), axes_of(rep.ins["aux"]), axes_of(rep.ins["b"]))

    def fwd(p, a, aux, b):
        out = jax.vmap(fwd1, in_axes=ins, axis_size=w, spmd_axis_name=spmd)(
            p, split(a, rep.ins["a"]), split(aux, rep.ins["aux"]), split(b, rep.ins["b"]))
        o, x = join(out[0], rep.outs["ct"]), join(out[1], rep.outs["aux_out"])
        return (o, x) if remat else (o, x, out[2])

    def cts_in(cts):  # the loss (kind "mean") is the replicas' mean: each gets 1/ways of its cotangent
        return [c.reshape((w, c.shape[0] // w) + c.shape[1:]) if k == "batch" else c / w
                for c, k in zip(cts, rep.outs["ct"])]

    def gather(ga):
        return [x.reshape((-1,) + x.shape[2:]) if k == "batch" else jnp.sum(x, axis=0)
                for x, k in zip(ga, rep.ins["a"])]

    ct_axes = axes_of(["batch" if k == "batch" else "same" for k in rep.outs["ct"]])
    if remat:
        def bwd(p, a, aux, b, cts):
            gp, ga = jax.vmap(bwd1, in_axes=ins + (ct_axes,), axis_size=w, spmd_axis_name=spmd)(
                p, split(a, rep.ins["a"]), split(aux, rep.ins["aux"]), split(b, rep.ins["b"]), cts_in(cts))
            return gp, gather(ga)
    else:
        def bwd(res, cts):
            gp, ga = jax.vmap(bwd1, in_axes=(0, ct_axes), axis_size=w, spmd_axis_name=spmd)(res, cts_in(cts))
            return gp, gather(ga)
    return fwd, bwd


def replica_sharding(sharding: jax.sharding.NamedSharding, axes: tuple[str, ...]) -> jax.sharding.NamedSharding:
    """`sharding` of a parameter with a leading replica dimension split over `axes`."""
    spec = tuple(sharding.spec)
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(axes, *spec))


def build_programs(optimizer: Any, sg: StageGraph, plan: Any, s: int, lay: StageLayout, jmesh, ops, own, bl,
                   acts_in, aux_in, outs, aux_out, p_shard, b_shard, zero_shapes,
                   replica: Replica | None = None, stacks: tuple[frozenset, frozenset] = (frozenset(), frozenset())
                   ) -> StagePrograms:
    """The stage's jitted forward, backward, gradient zeros and update: the pieces of `sg.graph`
    evaluated with `plan`'s sharding constraints (`planner.emit.single.constraint_hooks`) on `jmesh`; with
    `replica`, per data-parallel replica with the gradient reduction once per step, in the update
    (see the module docstring). `stacks`: the name stacks of the ops of the layers `lay` keeps and
    of those before them (`recompute_cut`), where it keeps its last layers under remat."""
    if sg.split is None and not lay.remat:
        raise InvalidArgumentError(
            f"stage {s}: its traced backward starts before its forward's outputs are made, so no forward "
            "program can be cut from it; run this stage with remat=True")
    cut = None
    if lay.kept_layers:
        cuts = [recompute_cut(g, *stacks) for g in ([sg] if replica is None else [sg, replica.sg])]
        cut = cuts[0] if None not in cuts and len(set(cuts)) == 1 else None
        if cut is None:
            log.warning("stage %d: no op of its program names only its last %d layers (or its backward "
                        "cannot be cut from its forward); it recomputes its whole forward instead",
                        s, lay.kept_layers)
            lay = dataclasses.replace(lay, kept_layers=0)
    remat = lay.recomputes_all
    if replica is None:
        fwd, bwd1 = _halves(sg, plan, jmesh, remat, cut)
        acc_shard = list(p_shard)
        acc_shapes = list(zero_shapes)
    else:
        fwd, bwd1 = _replicated_halves(replica, plan, jmesh, remat, cut)
        acc_shard = [replica_sharding(sh, replica.axes) for sh in p_shard]
        acc_shapes = [((replica.ways,) + tuple(shape), jnp.float32) for shape, _ in zero_shapes]

    def bwd(*args):
        *xs, cts, acc = args
        gp, ga = bwd1(*xs, [sum(c) for c in cts])
        return [x + y.astype(x.dtype) for x, y in zip(acc, gp)], ga

    def zeros():
        return [jnp.zeros(shape, dtype) for shape, dtype in acc_shapes]

    opt_shard = optimizer_shardings(p_shard, [shape for shape, _ in zero_shapes], replica) \
        if lay.shard_optimizer or lay.offload_optimizer else list(p_shard)
    sharded = [osh is not sh for osh, sh in zip(opt_shard, p_shard)]
    if lay.offload_optimizer:  # the optimizer state in host memory between updates
        opt_shard = [osh.with_memory_kind("pinned_host") for osh in opt_shard]
    if replica is not None:  # each gradient's once-per-step reduction in the format the plan priced,
        formats = replica_wire(plan, sg.graph, tuple(sg.outputs["p"]), replica.axes)
        reduction_of = {k: (formats[j], p_shard[j],  # by parameter leaf
                            opt_shard[j].with_memory_kind("device") if sharded[j] else p_shard[j])
                        for j, k in enumerate(own)}

    def apply(p, o, gr):
        p, p_hosted = _copied_in(p)  # master parameters kept in host memory (offload_params)
        if replica is not None:  # the data-parallel gradient reduction, once per step
            # the update's leaves: every owned parameter's, or one's (a streamed update, `runtime._updated`)
            present = [k for k, x in enumerate(jax.tree_util.tree_leaves(p, is_leaf=lambda x: x is None))
                       if x is not None]
            reductions = [reduction_of[k] for k in present]
            leaves, tree = jax.tree_util.tree_flatten(gr)
            gr = jax.tree_util.tree_unflatten(tree, [
                (reduce_replicas(x, f, sh, replica.axes) if osh is sh else scatter_replicas(x, f, sh, osh, replica.axes)
                 ).astype(q.dtype)
                for x, (f, sh, osh), q in zip(leaves, reductions, jax.tree_util.tree_leaves(p), strict=True)])
            split = any(osh is not sh for _, sh, osh in reductions)
            if split:  # the update on the optimizer state's shards, the parameter gathered back
                flat_p, ptree = jax.tree_util.tree_flatten(p)
                p = jax.tree_util.tree_unflatten(ptree, [
                    x if osh is sh else jax.lax.with_sharding_constraint(x, osh)
                    for x, (_, sh, osh) in zip(flat_p, reductions, strict=True)])
        o, hosted = _copied_in(o)  # the optimizer state kept in host memory (offloaded-optimizer)
        if hasattr(optimizer, "apply"):  # a step's own update ops (planner.stages.derived.GraphUpdate)
            new_p, o2 = optimizer.apply(p, o, gr)
        else:
            updates, o2 = optimizer.update(gr, o, p)
            new_p = optax.apply_updates(p, updates)
        o2 = _sent_back(o2, hosted)
        if replica is not None and split:
            flat_p, ptree = jax.tree_util.tree_flatten(new_p)
            new_p = jax.tree_util.tree_unflatten(ptree, [
                x if osh is sh else jax.lax.with_sharding_constraint(x, sh)
                for x, (_, sh, osh) in zip(flat_p, reductions, strict=True)])
        return _sent_back(new_p, p_hosted), o2

    nacc = 5 if remat else 2
    return StagePrograms(
        index=s, layout=lay, mesh=jmesh, ops=ops, params=own, batch=bl, acts_in=acts_in, aux_in=aux_in,
        outs=outs, aux_out=aux_out, param_shardings=p_shard, batch_shardings=b_shard,
        fwd=jax.jit(fwd),
        bwd=jax.jit(bwd, out_shardings=(acc_shard, None), donate_argnums=(nacc,)),
        zeros=jax.jit(zeros, out_shardings=acc_shard),
        apply=jax.jit(apply),
        plan=plan, stage_graph=sg, replica=replica, opt_shardings=tuple(opt_shard),
        casts=master_casts(sg, p_shard) if lay.offload_params else {},
    )


def _copied_in(tree: Any) -> tuple[Any, list[bool]]:
    """`tree` with its leaves in host memory copied to the device, and which leaves those were."""
    flat, treedef = jax.tree_util.tree_flatten(tree)
    hosted = [jax.typeof(x).memory_space == jax.memory.Space.Host for x in flat]
    return jax.tree_util.tree_unflatten(treedef, [jax.device_put(x, jax.memory.Space.Device) if h else x
                                                  for x, h in zip(flat, hosted)]), hosted


def _sent_back(tree: Any, hosted: list[bool]) -> Any:
    """`tree` (the new values of `_copied_in`'s leaves) with those that came from host memory sent back."""
    flat, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [jax.device_put(x, jax.memory.Space.Host) if h else x
                                                  for x, h in zip(flat, hosted)])


def master_casts(sg: StageGraph, p_shard) -> dict[int, Any]:
    """Per owned parameter (its position) that the stage's program reads only by casts to one narrower
    float dtype (mixed precision's master parameters), a jitted program copying it from host memory
    to the device as that cast (the microbatches' programs take the copy: their casts then change
    nothing, and the backward's cast of its cotangent back gives the float32 gradient as before)."""
    low = narrow_casts(sg.graph, sg.inputs["p"])
    return {j: jax.jit(lambda x, d=low[t]: jax.device_put(x, jax.memory.Space.Device).astype(d),
                       out_shardings=p_shard[j])
            for j, t in enumerate(sg.inputs["p"]) if t in low}


def optimizer_shardings(p_shard, shapes, replica: Replica | None) -> list:
    """Per owned parameter, its optimizer state's sharding in the sharded-optimizer layout:
    `core.sharding.optimizer_spec` over the replicas' axes (the parameter's own sharding, the same
    object, where nothing is added or the stage has no replicas)."""
    if replica is None:
        return list(p_shard)
    out = []
    for sh, shape in zip(p_shard, shapes, strict=True):
        spec = tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
        dims = [() if d is None else (d,) if isinstance(d, str) else tuple(d) for d in spec]
        ospec = optimizer_spec(tuple(shape), dims, replica.axes, dict(sh.mesh.shape))
        out.append(sh if ospec is None else jax.sharding.NamedSharding(
            sh.mesh, jax.sharding.PartitionSpec(*(d if d else None for d in ospec))))
    return out
