"""What the stage costing knows of each layer before any mesh: its ops, parameters and edges.

`layer_facts` sorts each layer's ops by phase and finds its parameters, their gradients and its
optimizer-state bytes; `subgraph` cuts a layer's ops out as a program of their own (what the
intra-op ILP plans, `layer_cost`); `layer_edges` and `boundary_bytes` are the forward values passed
between layers (resharded inside a stage, `LayerCostTable.inner`; sent across a stage boundary).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import jax
import numpy as np

from planner.graph.ir import Graph, Op
from planner.ilp.rules import OpSig, signature
from planner.ilp.strategies import rate_dtypes
from planner.stages.clustering import APPLY, BACKWARD, FORWARD, Layers


def external_inputs(graph: Graph, ops: Sequence[int]) -> tuple[int, ...]:
    """Tensors `ops` read but do not make (constants excluded), in order of first use."""
    produced = {t for i in ops for t in graph.ops[i].outputs}
    out: list[int] = []
    seen: set[int] = set()
    for i in sorted(ops):
        for t in graph.ops[i].tensor_inputs:
            if t not in produced and t not in seen and t not in graph.consts:
                seen.add(t)
                out.append(t)
    return tuple(out)


def subgraph(graph: Graph, ops: Sequence[int], name: str = "",
             updates: Sequence[tuple[int, int]] = (),
             exported: Collection[int] | None = None) -> tuple[Graph, tuple[int, ...]]:
    """The program made of `ops` alone: values from outside become inputs, values used outside outputs.

    Tensor ids are kept (ops are renumbered). Inputs that are program inputs keep their pytree path;
    the others are named `<name>act<id>`. Each `(param, grad)` in `updates` adds `param + grad` as
    an output under the parameter's own path: a one-op stand-in for the optimizer update, so that
    the intra-op plan stores the parameter where its update is cheap (output tied to the input)
    instead of replicated and sliced for free.

    `exported`: the values `ops` make that are used outside them (`LayerFacts.exported`), when the
    caller knows them (None: found by a pass over every op of `graph`).

    Returns:
      The subgraph and the tensor ids of its inputs (`external_inputs`).
    """
    ops = sorted(ops)
    inside = set(ops)
    path_of = dict(zip(graph.inputs, graph.input_paths))
    inputs = external_inputs(graph, ops)
    consts = {t: graph.consts[t] for i in ops for t in graph.ops[i].tensor_inputs if t in graph.consts}
    if exported is None:
        used_outside = {t for op in graph.ops if op.index not in inside for t in op.tensor_inputs}
        used_outside.update(t for t in graph.outputs if isinstance(t, int))
    else:
        used_outside = set(exported)
    outputs = [t for i in ops for t in graph.ops[i].outputs if t in used_outside]
    output_paths = [f"{name}out{t}" for t in outputs]
    new_ops = [dataclasses.replace(graph.ops[i], index=k) for k, i in enumerate(ops)]
    tensors = list(graph.tensors)
    in_set = set(inputs)
    produced = {t for i in ops for t in graph.ops[i].outputs}
    for param, grad in updates:
        if param in in_set and param in path_of and grad in produced:
            tensors.append(graph.tensors[param])
            out = len(tensors) - 1
            new_ops.append(Op(len(new_ops), jax.lax.add_p, {}, (param, grad), (out,), f"{name}update"))
            outputs.append(out)
            output_paths.append(path_of[param])
    sub = Graph(
        tensors=tuple(tensors) if updates else graph.tensors,
        ops=tuple(new_ops),
        inputs=inputs,
        input_paths=tuple(path_of.get(t, f"{name}act{t}") for t in inputs),
        outputs=tuple(outputs),
        output_paths=tuple(output_paths),
        consts=consts,
        in_tree=jax.tree_util.tree_structure(tuple(range(len(inputs)))),
        out_tree=jax.tree_util.tree_structure(tuple(range(len(outputs)))),
    )
    return sub, inputs


@dataclasses.dataclass(frozen=True, slots=True)
class LayerFacts:
    """What the costing needs to know about one layer, independent of the mesh."""

    ops: tuple[int, ...]          # forward + backward ops (planned by the ILP)
    apply_ops: tuple[int, ...]    # optimizer-update ops
    param_inputs: tuple[int, ...]  # program inputs the update writes back (parameters)
    param_grads: tuple[tuple[int, int], ...]  # (parameter, its gradient) pairs
    state_bytes_total: float      # bytes of every program input the update reads (params + optimizer state)
    param_bytes_total: float
    apply_flops: float
    saved: tuple[int, ...]        # forward values this layer's backward reads (kept between them)
    fwd_fraction: float           # forward FLOPs / (forward + backward FLOPs)
    apply_dtypes: tuple[np.dtype, ...] = ()  # the values whose precision sets the update's FLOP rate (`rate_dtypes`)
    exported: frozenset[int] = frozenset()  # values `ops` make that other ops or the program's outputs read


def layer_facts(graph: Graph, layers: Layers) -> tuple[LayerFacts, ...]:
    """Per layer: its ops by phase, its parameters and its optimizer-state bytes."""
    inputs = set(graph.inputs)
    apply_reads: list[set[int]] = [set() for _ in range(layers.num_layers)]
    grad_reads: list[set[int]] = [set() for _ in range(layers.num_layers)]
    for op in graph.ops:
        if layers.op_phase[op.index] == APPLY:
            apply_reads[layers.op_layer[op.index]].update(t for t in op.tensor_inputs if t in inputs)
        else:
            grad_reads[layers.op_layer[op.index]].update(t for t in op.tensor_inputs if t in inputs)
    grads = _gradients(graph, layers)
    fwd_made = {t for op in graph.ops if layers.op_phase[op.index] == FORWARD for t in op.outputs}
    sigs = [signature(op, graph) for op in graph.ops]
    flops = [sig.flops for sig in sigs]
    consumers = graph.consumers()
    program_outputs = {t for t in graph.outputs if isinstance(t, int)}
    planned: list[list[int]] = [[] for _ in range(layers.num_layers)]  # `Layers.ops_of` in one pass
    updating: list[list[int]] = [[] for _ in range(layers.num_layers)]
    for i, (l, phase) in enumerate(zip(layers.op_layer, layers.op_phase)):
        (updating if phase == APPLY else planned)[l].append(i)
    out = []
    for l in range(layers.num_layers):
        ops, apply_ops = tuple(planned[l]), tuple(updating[l])
        inside = set(ops)
        exported = frozenset(t for i in ops for t in graph.ops[i].outputs
                             if t in program_outputs or any(i not in inside for i, _ in consumers.get(t, ())))
        # Parameters: read by both the gradient computation and the update (optimizer state only by
        # the update, the batch only by the gradient computation).
        params = tuple(sorted(apply_reads[l] & grad_reads[l]))
        state = apply_reads[l]
        saved = sorted({t for i in ops if layers.op_phase[i] == BACKWARD
                        for t in graph.ops[i].tensor_inputs if t in fwd_made})
        f_fwd = sum(flops[i] for i in ops if layers.op_phase[i] == FORWARD)
        f_all = sum(flops[i] for i in ops)
        out.append(LayerFacts(
            ops=ops,
            apply_ops=apply_ops,
            param_inputs=params,
            param_grads=tuple((p, grads[p]) for p in params if p in grads),
            state_bytes_total=float(sum(graph.tensors[t].nbytes for t in state)),
            param_bytes_total=float(sum(graph.tensors[t].nbytes for t in params)),
            apply_flops=float(sum(flops[i] for i in apply_ops)),
            saved=tuple(saved),
            fwd_fraction=f_fwd / f_all if f_all else 0.0,
            apply_dtypes=tuple(sorted({d for i in apply_ops for d in _rate_dtypes(graph, graph.ops[i], sigs[i])},
                                      key=str)),
            exported=exported,
        ))
    return tuple(out)


def _rate_dtypes(graph: Graph, op: Op, sig: OpSig) -> tuple[np.dtype, ...]:
    ins = [graph.tensors[x] if isinstance(x, int) else None for x in op.inputs]
    return rate_dtypes(sig, ins, [graph.tensors[t] for t in op.outputs])


def _gradients(graph: Graph, layers: Layers) -> dict[int, int]:
    """Parameter input -> its gradient: the value made outside the update, of the parameter's type,
    from which the update computes the new value of the parameter (the output with its path)."""
    producers = graph.producers()
    out_by_path = {p: t for p, t in zip(graph.output_paths, graph.outputs) if isinstance(t, int)}
    result = {}
    for t, path in zip(graph.inputs, graph.input_paths):
        new = out_by_path.get(path)
        if new is None or new == t:
            continue
        stack, seen = [new], set()
        while stack:
            x = stack.pop()
            if x in seen or x not in producers:
                continue
            seen.add(x)
            op = graph.ops[producers[x][0]]
            if layers.op_phase[op.index] != APPLY:
                if graph.tensors[x] == graph.tensors[t]:
                    result[t] = x
                    break
                continue
            stack.extend(op.tensor_inputs)
    return result


def layer_edges(graph: Graph, layers: Layers, facts: Sequence[LayerFacts]) -> tuple[tuple, ...]:
    """Forward values made in one layer and read by the forward of a later one: per value
    (making layer, (op position in the layer's ops, result index), reading layer, position among the
    reading layer's `external_inputs`, tensor id)."""
    made: dict[int, tuple[int, tuple[int, int]]] = {}
    for l, f in enumerate(facts):
        for pos, i in enumerate(sorted(f.ops)):
            if layers.op_phase[i] == FORWARD:
                for k, t in enumerate(graph.ops[i].outputs):
                    made[t] = (l, (pos, k))
    out = []
    for c, f in enumerate(facts):
        reads = {t for i in f.ops if layers.op_phase[i] == FORWARD for t in graph.ops[i].tensor_inputs}
        for j, t in enumerate(external_inputs(graph, f.ops)):
            if t in made and t in reads and made[t][0] < c:
                out.append((made[t][0], made[t][1], c, j, t))
    return tuple(out)


def boundary_bytes(graph: Graph, layers: Layers) -> np.ndarray:
    """`out[l]`: bytes of forward values made in layers <= l and used by forward ops of later layers
    (the activations a stage boundary after layer l sends per microbatch; the backward sends as many)."""
    L = layers.num_layers
    fwd = [op for op in graph.ops if layers.op_phase[op.index] == FORWARD]
    made = {t: layers.op_layer[op.index] for op in fwd for t in op.outputs}
    last_use: dict[int, int] = {}
    for op in fwd:
        for t in op.tensor_inputs:
            if t in made:
                last_use[t] = max(last_use.get(t, -1), layers.op_layer[op.index])
    delta = np.zeros(L + 1)
    for t, first in made.items():
        last = last_use.get(t, first)
        if last > first:
            delta[first] += graph.tensors[t].nbytes
            delta[last] -= graph.tensors[t].nbytes
    return np.cumsum(delta)[:L]
