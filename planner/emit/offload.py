"""Emitting a plan that offloads: its host-memory shardings and the copies between host and device in the step."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import numpy as np

from planner.graph.ir import Graph
from planner.ilp.offload import DEVICE, HOST, sliced_from


def positions(plan) -> tuple[frozenset[int], frozenset[int]]:
    """(argument positions, output positions) a plan keeps on the host."""
    info = plan.levers.offload
    if info is None:
        return frozenset(), frozenset()
    return frozenset(info.inputs), frozenset(info.outputs)


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))


def in_shardings(plan):
    """`plan.in_shardings` with the offloaded arguments in host memory."""
    ins, _ = positions(plan)
    shardings = plan.in_shardings
    if not ins:
        return shardings
    leaves = [s.with_memory_kind(HOST) if i in ins else s for i, s in enumerate(_leaves(shardings))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shardings, is_leaf=_is_sharding), leaves)


def out_shardings(plan):
    """`plan.out_shardings` with the offloaded new values in host memory."""
    _, outs = positions(plan)
    shardings = plan.out_shardings
    if not outs:
        return shardings
    leaves = [s.with_memory_kind(HOST) if i in outs and s is not None else s for i, s in enumerate(_leaves(shardings))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shardings, is_leaf=_is_sharding), leaves)


def _is_sharding(x) -> bool:
    return x is None or isinstance(x, jax.sharding.Sharding)


def emission_hooks(graph: Graph, plan, before_op, after_op):
    """(before_op, after_op, finish) for one `Graph.evaluate` inside the planned jit (make them per
    trace: they hold that trace's values): `before_op` copies an offloaded argument to device
    memory where an op first reads it (in its planned layout), in a streamed update
    (`Graph.update_groups`) only once the previous group's new values exist, then applies the plan's
    own `before_op`; `after_op` applies the plan's and notes each group's new values;
    `finish(outputs)` sends the offloaded new values back to host memory. The plan's hooks
    unchanged when it offloads nothing."""
    ins, outs = positions(plan)
    if not ins:
        return before_op, after_op, lambda values: values
    early = frozenset(plan.levers.offload.host_reads)  # casts of master parameters (or of one layer's slice)
    shardings = _leaves(plan.in_shardings)
    device = {graph.inputs[i]: shardings[i].with_memory_kind(DEVICE) for i in ins}
    device.update(_layer_slices(graph, early, device))
    host = {i: s.with_memory_kind(HOST) for i, s in enumerate(_leaves(plan.out_shardings)) if i in outs}
    group_of = {i: g for g, (a, b) in enumerate(graph.update_groups) for i in range(a, b)}
    results = {t for t in graph.outputs if isinstance(t, int)}
    done: dict[int, list] = defaultdict(list)  # group -> its new values (program outputs) so far
    moved: dict[int, Any] = {}  # offloaded argument -> its copy on the device for the update
    cast: set[int] = set()  # offloaded arguments copied in before the update (master parameters)
    last: list = []  # the latest op's first result

    def before(op, operands):
        values = []
        for x, v in zip(op.inputs, operands):
            if isinstance(x, int) and x in device:
                if op.index in early:  # a cast before the update: a copy for this op alone
                    cast.add(x)
                    values.append(jax.device_put(v, device[x]))
                    continue
                if x not in moved:
                    g = group_of.get(op.index)
                    if g and done.get(g - 1):  # one group's state on the device at a time
                        v = jax.lax.optimization_barrier([v, *done[g - 1]])[0]
                    elif x in cast and last:  # not the cast's copy again (XLA would merge the two and
                        v = jax.lax.optimization_barrier([v, last[0]])[0]  # hold it through the step)
                    moved[x] = jax.device_put(v, device[x])
                v = moved[x]
            values.append(v)
        return before_op(op, values) if before_op is not None else values

    def after(op, values):
        values = after_op(op, values) if after_op is not None else values
        if values:
            last[:] = [values[0]]
        g = group_of.get(op.index)
        if g is not None:
            done[g].extend(v for t, v in zip(op.outputs, values) if t in results)
        return values

    def finish(values):
        return [jax.device_put(v, host[i]) if i in host else v for i, v in enumerate(values)]

    return before, after, finish


def _layer_slices(graph: Graph, early: frozenset[int], device: dict[int, Any]) -> dict[int, Any]:
    """Device shardings of the layer slices of offloaded stacked parameters that early ops cast
    (`planner.ilp.offload._slice_reads`: a slice of the leading axis, squeezed): the tensor the
    cast reads (in a scan's body, the iteration's input, which `lax.scan` slices from the host
    array) -> the parameter's sharding without its leading axis, in device memory."""
    producers = graph.producers()
    out = {}
    for o in early:
        for x in graph.ops[o].tensor_inputs:
            if x in device:
                continue
            s = device.get(sliced_from(graph, producers, x))
            if isinstance(s, jax.sharding.NamedSharding):
                out[x] = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]),
                                                    memory_kind=DEVICE)
    return out


def abstract_args(plan, args):
    """`args` as `jax.ShapeDtypeStruct`s carrying the offload-aware input shardings (lowering
    concrete device arrays against host in-shardings is an error in `jax.jit`)."""
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), args,
                                  in_shardings(plan))
