"""Emitting gradient accumulation: the microbatch plan's step run k times in a `lax.scan`, gradients summed."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from planner.core.sharding import named_sharding
from planner.emit.wire import op_hooks
from planner.emit.single import constraint_hooks
from planner.graph.ir import Literal
from planner.levers.accumulate import Accumulated, grad_specs
from planner.stages.derived import op_ranges


def accumulated_function(acc: Accumulated) -> Callable[..., Any]:
    """The k-microbatch step as a function of the step's full-batch arguments, every op pinned to
    the microbatch plan's layouts (`emit.single.constraint_hooks`). Must run under `jax.jit`."""
    graph, parts, plan, k = acc.graph, acc.parts, acc.plan, acc.k
    mesh = plan._mesh()
    before_op, after_op = constraint_hooks(plan, mesh, graph)
    before_op, on_shards = op_hooks(plan, mesh, graph, before_op)
    upd = set(parts.update)
    record = plan.levers.accumulation
    hoisted = (record.unsharded if record is not None else None) or ()
    in_loop = (record.resharded_per_microbatch if record is not None else None) or ()
    once = sorted({op for h in hoisted for op in h.ops})
    outside = upd.union(once)  # ops not run in the microbatch loop
    grad_ranges = op_ranges(tuple(i for i in range(len(graph.ops)) if i not in outside))
    copies = [(h.tensor, named_sharding(h.spec, plan.mesh, mesh)) for h in hoisted]
    update_ranges = op_ranges(tuple(parts.update))
    grad_shardings = [named_sharding(s, plan.mesh, mesh) for s in grad_specs(graph, parts, plan)]
    batch_shardings = [named_sharding(plan.input_specs[p], plan.mesh, mesh) for p in parts.batch]
    batch_ids = [graph.inputs[p] for p in parts.batch]
    loss_dtype = graph.tensors[parts.loss].dtype

    def fn(*args):
        flat = jax.tree_util.tree_leaves(args)
        env: dict[int, Any] = dict(graph.consts)
        env.update(zip(graph.inputs, flat))
        # (B, ...) -> (B/k, k, ...): a reshape, no copy; microbatch j is column j (rows j, j+k, ...).
        rows = [jnp.reshape(flat[p], (flat[p].shape[0] // k, k) + tuple(flat[p].shape[1:])) for p in parts.batch]
        # selective unsharding (`unshard`): loop-invariant values resharded once, before the loop
        for i in once:
            graph.run_range(i, i + 1, env, before_op, after_op, apply_op=on_shards)
        gathered = {t: jax.lax.with_sharding_constraint(env[t], s) for t, s in copies}  # read by the loop only

        def body(carry, j):
            grads, loss = carry
            local = dict(env)
            local.update(gathered)
            # invariant reshardings planned per microbatch stay in the loop (`unshard`)
            local.update((t, jax.lax.optimization_barrier((env[t], j))[0]) for t in in_loop)
            local.update((t, jax.lax.with_sharding_constraint(jax.lax.dynamic_index_in_dim(x, j, 1, False), s))
                         for t, x, s in zip(batch_ids, rows, batch_shardings))
            for start, end in grad_ranges:
                graph.run_range(start, end, local, before_op, after_op, apply_op=on_shards)
            grads = [jax.lax.with_sharding_constraint(a + local[g].astype(jnp.float32), s)
                     for a, g, s in zip(grads, parts.grads, grad_shardings)]
            return (grads, loss + local[parts.loss].astype(jnp.float32)), None

        zeros = [jax.lax.with_sharding_constraint(jnp.zeros(graph.tensors[g].shape, jnp.float32), s)
                 for g, s in zip(parts.grads, grad_shardings)]
        (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), jnp.arange(k))
        env.update((g, (a / k).astype(graph.tensors[g].dtype)) for g, a in zip(parts.grads, grads))
        for start, end in update_ranges:
            graph.run_range(start, end, env, before_op, after_op, apply_op=on_shards)
        env[parts.loss] = (loss / k).astype(loss_dtype)
        outs = [x.value if isinstance(x, Literal) else env[x] for x in graph.outputs]
        return jax.tree_util.tree_unflatten(graph.out_tree, outs)

    return fn


def jit_accumulated(acc: Accumulated, donate_argnums: int | tuple[int, ...] = ()) -> jax.stages.Wrapped:
    """`jax.jit` of the accumulated step with the plan's in/out shardings (the batch arguments keep
    the microbatch's layout: the same dims split the same way)."""
    return jax.jit(accumulated_function(acc), in_shardings=acc.plan.in_shardings,
                   out_shardings=acc.plan.out_shardings, donate_argnums=donate_argnums)
