"""The compiled programs of one pipeline stage: forward, backward, gradient zeros and update.

Each is a `jax.jit` of the stage's ops re-interpreted from the traced `loss_fn` (the ops of its
layers, bound in program order), on the stage's submesh with its planned shardings.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from planner.graph import Graph, Literal
from planner.stages.layout import StageLayout


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


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def build_programs(optimizer: Any, graph: Graph, s: int, lay: StageLayout, jmesh, ops, own, bl, n_params,
              acts_in, aux_in, outs, aux_out, p_shard, b_shard) -> StagePrograms:
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

    def apply(p, o, g):
        updates, o2 = optimizer.update(g, o, p)
        return optax.apply_updates(p, updates), o2

    nacc = 5 if lay.remat else 2
    return StagePrograms(
        index=s, layout=lay, mesh=jmesh, ops=ops, params=own, batch=bl, acts_in=acts_in, aux_in=aux_in,
        outs=outs, aux_out=aux_out, param_shardings=p_shard, batch_shardings=b_shard,
        fwd=jax.jit(fwd),
        bwd=jax.jit(bwd, out_shardings=(list(p_shard), None), donate_argnums=(nacc,)),
        zeros=jax.jit(zeros, out_shardings=list(p_shard)),
        apply=jax.jit(apply),
    )
