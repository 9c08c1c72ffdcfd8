"""Applying a plan: `jax.jit` with the planned in/out shardings, and `with_sharding_constraint`
on every planned intermediate, inserted by re-interpreting the traced graph."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from planner.emit import offload
from planner.emit.wire import op_hooks
from planner.core.compat import USER_CONSTRAINTS
from planner.core.errors import InvalidArgumentError
from planner.graph.ir import Graph, Op
from planner.core.plan import Plan
from planner.core.sharding import named_sharding


def constrained_function(graph: Graph, plan: Plan) -> Callable[..., Any]:
    """A function of the original arguments that evaluates `graph` with the plan's constraints.

    Every intermediate the plan decided (replicated ones too) is pinned, so XLA's sharding
    propagation cannot drift from the plan; free tensors (iotas, constants) are left to XLA. The
    step's own sharding constraints are always applied, in the layout the plan gave them (their
    spec when pinned). Meshes whose axes are not all Auto are emitted on their Auto view
    (`mesh.auto_view`), so only `with_sharding_constraint` is needed.
    Must be called under `jax.jit` (sharding constraints need a tracing context).
    """
    remat, offloaded = plan.levers.remat, plan.levers.offload
    if remat is not None and ((remat.layers and not graph.recompute)
                              or (remat.scans and not (graph.source and graph.source.scans_recomputed))):
        raise InvalidArgumentError("this plan recomputes layers: emit it on the graph it was made for, "
                                   "planner.levers.remat.graph_for(trace(fn, *args), plan)")
    if offloaded is not None and offloaded.streamed and not graph.update_groups:
        raise InvalidArgumentError("this plan streams the optimizer update: emit it on the graph it was made for, "
                                   "planner.ilp.offload.graph_for(trace(fn, *args), plan)")
    before_op, after_op = constraint_hooks(plan, plan._mesh(), graph)
    before_op, on_shards = op_hooks(plan, plan._mesh(), graph, before_op)

    def fn(*args):
        # host-offloaded state (`planner.ilp.offload`): hooks made per trace (they hold its values)
        before, after, to_host = offload.emission_hooks(graph, plan, before_op, after_op)
        outs = to_host(graph.evaluate(jax.tree_util.tree_leaves(args), after, before, on_shards))
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    return fn


def constraint_hooks(plan: Plan, mesh: jax.sharding.Mesh, graph: Graph | None = None):
    """The `(before_op, after_op)` hooks of `Graph.evaluate` / `Graph.run_range` that pin the
    plan's operands and intermediates on `mesh` (a `jax.sharding.Mesh` of `plan.mesh`'s shape).
    With `graph`, the step's own sharding constraints stay pinned when `constrain_intermediates` is off."""
    wanted: dict[tuple[int, int], jax.sharding.NamedSharding] = {}
    constrain = plan.options.constrain_intermediates
    if constrain:
        wanted = {(op, k): named_sharding(spec, plan.mesh, mesh) for op, k, spec in plan.op_specs}
    elif graph is not None:  # the step's own constraints evaluate as identity: the plan's constraint places them
        wanted = {(op, k): named_sharding(spec, plan.mesh, mesh) for op, k, spec in plan.op_specs
                  if op < len(graph.ops) and graph.ops[op].name in USER_CONSTRAINTS}
    first = {(op, k): named_sharding(spec, plan.mesh, mesh) for op, k, spec in plan.scatter_specs}
    reads = ({(op, k): named_sharding(spec, plan.mesh, mesh) for op, k, spec in plan.operand_specs}
             if constrain and wanted else {})

    def before_op(op: Op, operands: list[Any]) -> list[Any]:
        return [jax.lax.with_sharding_constraint(v, reads[(op.index, k)]) if (op.index, k) in reads else v
                for k, v in enumerate(operands)]

    def pin(key: tuple[int, int], v: Any) -> Any:
        if key in first:
            v = jax.lax.with_sharding_constraint(v, first[key])
        if key in wanted:
            v = jax.lax.with_sharding_constraint(v, wanted[key])
        return v

    def after_op(op: Op, outs: list[Any]) -> list[Any]:
        return [pin((op.index, k), v) for k, v in enumerate(outs)]

    return before_op, after_op


def jit_planned(graph: Graph, plan: Plan, donate_argnums: int | tuple[int, ...] = ()) -> jax.stages.Wrapped:
    """`jax.jit` of the planned program with the plan's input and output shardings."""
    return jax.jit(
        constrained_function(graph, plan),
        in_shardings=offload.in_shardings(plan),
        out_shardings=offload.out_shardings(plan),
        donate_argnums=donate_argnums,
    )


def jit_on_mesh(graph: Graph, plan: Plan, mesh: jax.sharding.Mesh,
                donate_argnums: int | tuple[int, ...] = ()) -> jax.stages.Wrapped | None:
    """`jax.jit` of the planned program taking and handing back arrays on `mesh` (the user's mesh,
    every axis Explicit, the plan's devices), called under `jax.set_mesh(mesh)`: the program runs
    inside `jax.sharding.auto_axes` (every axis Auto, as the plan was made on the mesh's Auto view),
    so a step's results need no `jax.device_put` onto the user's mesh and come back as the next
    step's arguments as they are. The same constraints, so the same compiled collectives and memory
    as `jit_planned`'s program. None where it does not apply: a plan that offloads (memory kinds),
    one that leaves an output's sharding to XLA, and a mesh of mixed axis types (a step's
    `jax.sharding.reshard` onto its Explicit axes fails where `auto_axes` has made every axis
    Auto; tests/test_jax_idioms.py `test_mesh_of_every_axis_type[mixed]`)."""
    outs = offload.out_shardings(plan)
    leaves = jax.tree_util.tree_leaves(outs, is_leaf=lambda x: x is None)
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if not explicit or offload.positions(plan)[0] or any(s is None for s in leaves):
        return None
    specs = jax.tree_util.tree_map(lambda s: s.spec, outs)
    return jax.jit(jax.sharding.auto_axes(constrained_function(graph, plan), out_sharding=specs),
                   in_shardings=on_mesh(plan.in_shardings, mesh), out_shardings=on_mesh(outs, mesh),
                   donate_argnums=donate_argnums)


def on_mesh(shardings: Any, mesh: jax.sharding.Mesh) -> Any:
    """A tree of `NamedSharding`s with the same specs and memory kinds on `mesh`."""
    return jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s.spec, memory_kind=s.memory_kind),
                                  shardings)
