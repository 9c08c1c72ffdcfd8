"""What a stage costs: per-layer intra-op plans, reused across identical layers, summed over ranges.

Alpa compiled and profiled every (layer range, submesh) pair; here each *distinct* layer (layers
with equal `Layers.keys` are identical: same ops, same shapes) is planned once per logical mesh by
the intra-op ILP on the subgraph of its forward and backward ops, at the microbatch size. A range
of layers then costs the sum of its layers' times, and its memory is assembled from theirs. For a
GPT that is three ILPs per logical mesh (first block with the embedding, a middle block, last
block with the head and loss), whatever the depth.

Per layer and logical mesh the plan gives:
  time_s      forward + backward time of one microbatch (compute and collectives, ILP prediction),
  apply_s     the optimizer update once per step (roofline of the update ops, sharded like the params),
  state_bytes parameters + gradient accumulator + optimizer state per device,
  act_bytes   activations kept from forward to backward, per microbatch in flight, per device,
  work_bytes  transient working memory of the layer's step beyond those.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import jax
import numpy as np

from planner.cost_model import Hardware
from planner.errors import MeshError, PlannerError
from planner.graph import Graph
from planner.ilp.rules import signature
from planner.ilp.strategies import shard_bytes
from planner.options import PlanOptions
from planner.planning import make_plan
from planner.sharding import Spec, replicated
from planner.stages.clustering import APPLY, BACKWARD, FORWARD, Layers
from planner.stages.submesh import Cluster, LogicalMesh

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Predicted cost of one layer on one logical mesh (see the module docstring).

    Attributes:
      input_specs: the plan's sharding of each external input of the layer's subgraph, in the
        subgraph's input order (identical layers list their inputs in the same order).
    """

    time_s: float
    apply_s: float
    state_bytes: float
    act_bytes: float
    work_bytes: float
    input_specs: tuple[Spec | None, ...] = ()


INFEASIBLE = LayerCost(math.inf, math.inf, math.inf, math.inf, math.inf)


def subgraph(graph: Graph, ops: Sequence[int], name: str = "") -> tuple[Graph, tuple[int, ...]]:
    """The program made of `ops` alone: values from outside become inputs, values used outside outputs.

    Tensor ids are kept (the tensor table is shared); ops are renumbered. Inputs that are program
    inputs keep their pytree path; the others are named `<name>act<id>`.

    Returns:
      The subgraph and the tensor ids of its inputs (in order of first use).
    """
    ops = sorted(ops)
    inside = set(ops)
    produced = {t for i in ops for t in graph.ops[i].outputs}
    path_of = dict(zip(graph.inputs, graph.input_paths))
    inputs: list[int] = []
    seen: set[int] = set()
    consts = {}
    for i in ops:
        for t in graph.ops[i].tensor_inputs:
            if t in produced or t in seen:
                continue
            if t in graph.consts:
                consts[t] = graph.consts[t]
                continue
            seen.add(t)
            inputs.append(t)
    used_outside = {t for op in graph.ops if op.index not in inside for t in op.tensor_inputs}
    used_outside.update(t for t in graph.outputs if isinstance(t, int))
    outputs = [t for i in ops for t in graph.ops[i].outputs if t in used_outside]
    new_ops = tuple(dataclasses.replace(graph.ops[i], index=k) for k, i in enumerate(ops))
    sub = Graph(
        tensors=graph.tensors,
        ops=new_ops,
        inputs=tuple(inputs),
        input_paths=tuple(path_of.get(t, f"{name}act{t}") for t in inputs),
        outputs=tuple(outputs),
        output_paths=tuple(f"{name}out{t}" for t in outputs),
        consts=consts,
        in_tree=jax.tree_util.tree_structure(tuple(range(len(inputs)))),
        out_tree=jax.tree_util.tree_structure(tuple(range(len(outputs)))),
    )
    return sub, tuple(inputs)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerFacts:
    """What the costing needs to know about one layer, independent of the mesh."""

    ops: tuple[int, ...]          # forward + backward ops (planned by the ILP)
    apply_ops: tuple[int, ...]    # optimizer-update ops
    param_inputs: tuple[int, ...]  # program inputs the update writes back (parameters)
    state_bytes_total: float      # bytes of every program input the update reads (params + optimizer state)
    param_bytes_total: float
    apply_flops: float


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
    out = []
    for l in range(layers.num_layers):
        ops = layers.ops_of(l, (FORWARD, BACKWARD))
        apply_ops = layers.ops_of(l, (APPLY,))
        # Parameters: read by both the gradient computation and the update (optimizer state only by
        # the update, the batch only by the gradient computation).
        params = tuple(sorted(apply_reads[l] & grad_reads[l]))
        state = apply_reads[l]
        out.append(LayerFacts(
            ops=ops,
            apply_ops=apply_ops,
            param_inputs=params,
            state_bytes_total=float(sum(graph.tensors[t].nbytes for t in state)),
            param_bytes_total=float(sum(graph.tensors[t].nbytes for t in params)),
            apply_flops=float(sum(signature(graph.ops[i], graph).flops for i in apply_ops)),
        ))
    return tuple(out)


def _layer_cost(graph: Graph, layers: Layers, facts: LayerFacts, layer: int, lmesh: LogicalMesh,
                hardware: Hardware, options: PlanOptions) -> LayerCost:
    sub, ext = subgraph(graph, facts.ops, f"{layers.names[layer]}/")
    if not sub.ops:
        return LayerCost(0.0, 0.0, 0.0, 0.0, 0.0, ())
    cost = lmesh.cost_model(hardware)
    opts = dataclasses.replace(options, memory_budget=None, pipeline=False, tie_outputs=False,
                               inter_host_axes=lmesh.host_axes, hardware=hardware)
    try:
        plan = make_plan(sub, lmesh.mesh, opts)
    except (MeshError, PlannerError) as e:
        log.info("layer %s on %s: %s", layers.names[layer], lmesh.mesh, e)
        return INFEASIBLE
    mesh = lmesh.mesh
    spec_of_input = dict(zip(ext, plan.input_specs))
    param_set = set(facts.param_inputs)
    param_shard = sum(shard_bytes(graph.tensors[t], spec_of_input.get(t) or replicated(len(graph.tensors[t].shape)),
                                  mesh) for t in ext if t in param_set)
    ratio = param_shard / facts.param_bytes_total if facts.param_bytes_total else 1.0 / mesh.size
    state = 2 * param_shard + (facts.state_bytes_total - facts.param_bytes_total) * ratio
    # Activations kept for the backward pass: values made by forward ops, read by this layer's backward ops.
    produced_spec = {}
    for op_index, k, spec in plan.op_specs:
        produced_spec[sub.ops[op_index].outputs[k]] = spec
    produced_spec.update(spec_of_input)
    fwd_made = {t for op in graph.ops if layers.op_phase[op.index] == FORWARD for t in op.outputs}
    saved: set[int] = set()
    for i in facts.ops:
        if layers.op_phase[i] == BACKWARD:
            saved.update(t for t in graph.ops[i].tensor_inputs if t in fwd_made)
    act = 0.0
    for t in saved:
        spec = produced_spec.get(t)
        act += shard_bytes(graph.tensors[t], spec, mesh) if spec is not None else graph.tensors[t].nbytes
    peak = float(plan.prediction.memory_bytes_per_device)
    work = max(0.0, peak - param_shard - act)
    apply_bytes = 2 * facts.state_bytes_total + facts.param_bytes_total
    apply_s = cost.compute_time(facts.apply_flops * ratio, apply_bytes * ratio)
    return LayerCost(plan.prediction.step_time_s, apply_s, state, act, work,
                     tuple(spec_of_input.get(t) for t in ext))


@dataclasses.dataclass(slots=True)
class LayerCostTable:
    """Costs of every layer on every logical mesh, planned once per distinct layer.

    `cost(layer, mesh_index)` is a LayerCost; `cache` maps (layer key, mesh shape, links) to it and
    may be shared between tables (e.g. for several microbatch sizes whose layers coincide).
    """

    graph: Graph
    layers: Layers
    meshes: tuple[LogicalMesh, ...]
    cluster: Cluster
    options: PlanOptions
    cache: dict = dataclasses.field(default_factory=dict)
    facts: tuple[LayerFacts, ...] = ()
    solves: int = 0

    def __post_init__(self):
        if not self.facts:
            self.facts = layer_facts(self.graph, self.layers)

    def cost(self, layer: int, mesh_index: int) -> LayerCost:
        lm = self.meshes[mesh_index]
        key = (self.layers.keys[layer], lm.mesh.shape, lm.links, self.cluster.hardware.name)
        hit = self.cache.get(key)
        if hit is None:
            hit = _layer_cost(self.graph, self.layers, self.facts[layer], layer, lm,
                              self.cluster.effective_hardware(), self.options)
            self.cache[key] = hit
            self.solves += 1
        return hit


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


def layer_cost_arrays(table: LayerCostTable, mesh_indices: Sequence[int]) -> Mapping[str, np.ndarray]:
    """Per field of LayerCost, an array [layer, mesh] over the given logical meshes."""
    L = table.layers.num_layers
    fields = ("time_s", "apply_s", "state_bytes", "act_bytes", "work_bytes")
    out = {f: np.zeros((L, len(mesh_indices))) for f in fields}
    for l in range(L):
        for j, m in enumerate(mesh_indices):
            c = table.cost(l, m)
            for f in fields:
                out[f][l, j] = getattr(c, f)
    return MappingProxyType(out)
