"""What a stage costs: per-layer intra-op plans, reused across identical layers, summed over ranges.

Alpa compiled and profiled every (layer range, submesh) pair; here each *distinct* layer (layers
with equal `Layers.keys` are identical: same ops, same shapes) is planned once per logical mesh by
the intra-op ILP (`make_plan`) on the subgraph of its forward and backward ops at the microbatch
size, plus a one-op stand-in for each parameter's update (`param + grad`, tied to the parameter,
so the plan stores parameters where their update is cheap). A range of layers then costs the sum
of its layers' times, and its memory is assembled from theirs. For a GPT that is three ILPs per
logical mesh (embedding, one block, head and loss), whatever the depth: GPT-39B's 48 blocks cost
one block's plan.

Per layer and logical mesh the plan gives:
  time_s      forward + backward time of one microbatch (compute and collectives, ILP prediction)
              without the data-parallel gradient reduction,
  sync_s      that gradient reduction, once per step (see below),
  apply_s     the optimizer update once per step (roofline of the update ops, sharded like the params),
  state_bytes parameters + gradient accumulator + optimizer state per device,
  act_bytes   activations kept from forward to backward, per microbatch in flight, per device,
  work_bytes  transient working memory of the layer's step beyond those.

Gradients are accumulated over the microbatches on each data-parallel replica and reduced once per
step, before the update (as Megatron-LM and any gradient-accumulating trainer do), so the layer's
data-parallel gradient reduction is taken out of its per-microbatch time (`grad_sync`): the
collectives the plan predicts with reason "partial sum" over only the axes that split the
layer's batch dimension (dim 0 of its non-parameter inputs), i.e. the reductions of batch
contractions (weight, bias and norm-scale gradients; the loss mean's scalar one too). They are
priced as the ILP priced them (combined: bandwidth per collective, one latency per (kind, axes)
group); the per-microbatch time drops by their exposed part (their time beyond the communication
the plan hides behind compute, which they are first to use), and `sync_s` keeps all of it, exposed:
the stage pays it once after its last backward (`inter_op._once_per_step_max`), not overlapped
with other stages' remaining backwards (a simplification, stated).

Each layer's plan also chooses the layouts its inputs are read in and its outputs made in; where
one layer of a stage makes a value in another layout than a later layer of the same stage reads it
in, the stage pays the resharding, forward and backward (`LayerCostTable.inner`, priced by the
ILP's `reshard_cost`).

A stage runs in one of four ways, and the DP takes the fastest that fits the device memory (the
intra-op ILP plans each layer for time alone; it has no stage-level view of memory):
  state layout "plan"           parameters stored as the plan shards them;
               "sharded-state"  parameters, gradient accumulators and optimizer state split over every
                                device of the stage (ZeRO-3 on top of the plan), the plan's layout
                                all-gathered before the forward and again before the backward;
  remat False  activations kept from each microbatch's forward to its backward;
        True   only the stage's input kept; the backward recomputes the stage's forward first
               (extra time: the forward's share of the FLOPs, times the layer's time).

The per-layer ILP plans for time alone, so each layer's plan is the fastest and, where memory
binds, often not the leanest: a stage of Megatron-style tensor-parallel layers, or of fully
sharded (ZeRO-3) ones, can fit where the fastest plans only fit with recomputation or more stages.
So the tables hold, besides each layer's own plan, *variants*: the layer planned again with the
program inputs it reads (parameters, optimizer state, the batch) pinned to a hand layout
(`LayerCostTable.variants`, `LAYER_VARIANTS`: the named baselines `megatron-tp` and `fsdp`,
`planner.configs.baselines`), everything else still chosen by the ILP. Every variant of a stage runs in
the four ways above, and the DP picks among all of them (`StageOption.variant`). Those hand
layouts are then points of the search: a `NAME+ppN` baseline (`inter_op.fixed_pipeline`) is one
of the pipelines the DP prices.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import numpy as np

from planner.cost_model import Cluster, Hardware
from planner.core.errors import MeshError, PlannerError
from planner.graph.trace import Graph, Op
from planner.ilp.rules import OpSig, signature
from planner.ilp.strategies import rate_dtypes, reshard_cost, shard_bytes
from planner.core.options import PlanOptions
from planner.core.plan import PredictedCollective, stage_way
from planner.search.mesh_plan import make_plan
from planner.search.meshes import idle_cores
from planner.core.sharding import Spec, active_axes, replicated, spec_axes
from planner.stages.clustering import APPLY, BACKWARD, FORWARD, Layers
from planner.stages.submesh import LogicalMesh, boundary_link, effective_hardware

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Predicted cost of one layer on one logical mesh (see the module docstring).

    Attributes:
      fwd_fraction: the forward's share of the layer's FLOPs (what rematerialisation repeats).
      input_specs: the plan's sharding of each external input of the layer's subgraph, in the
        subgraph's input order (identical layers list their inputs in the same order).
      zero_extra_s: extra all-gather time per microbatch of the sharded-state layout.
      zero_state_bytes: state bytes per device of the sharded-state layout.
      zero_specs: per external input, its sharded-state layout (None: not a parameter).
      sync_s: the data-parallel gradient reduction, once per step (not in `time_s`).
      comm_s: the exposed communication inside `time_s` (the plan's exposed communication without
        the part of the gradient reduction taken out to `sync_s`).
      hidden_s: communication the plan hides behind compute, per microbatch.
      data_axes: names of the mesh axes splitting the layer's batch (`batch_axes`).
      collectives: the layer plan's predicted collectives per microbatch (what a pipeline plan lists
        for the stage when the stage programs cannot be built, `planned.to_plan`).
      zero_collectives: the sharded-state layout's parameter all-gathers per microbatch (each
        gathered parameter twice: forward and backward), priced as `zero_extra_s` prices them.
      produced_specs: the plan's sharding of each value the layer makes that is used outside it,
        keyed by (position of the making op among the layer's ops, result index), so that identical
        layers key alike (`LayerCostTable.inner`: resharding between layers of one stage).
    """

    time_s: float
    apply_s: float
    state_bytes: float
    act_bytes: float
    work_bytes: float
    fwd_fraction: float = 0.0
    input_specs: tuple[Spec | None, ...] = ()
    zero_extra_s: float = 0.0
    zero_state_bytes: float = 0.0
    zero_work_bytes: float = 0.0
    zero_specs: tuple[Spec | None, ...] = ()
    sync_s: float = 0.0
    produced_specs: Mapping[tuple[int, int], Spec] = dataclasses.field(default_factory=dict)
    comm_s: float = 0.0
    hidden_s: float = 0.0
    data_axes: frozenset[str] = frozenset()
    collectives: tuple = ()
    zero_collectives: tuple = ()


# The hand layouts each layer is also planned in (`LayerCostTable.variants`; see the module docstring).
LAYER_VARIANTS = ("megatron-tp", "fsdp")
INFEASIBLE = LayerCost(math.inf, math.inf, math.inf, math.inf, math.inf, 0.0, (), math.inf, math.inf, math.inf, (),
                       math.inf)
LAYOUTS = ("plan", "sharded-state")


def zero_spec(shape: tuple[int, ...], spec: Spec, mesh) -> Spec:
    """`spec` with every mesh axis it leaves unused added to a dimension it divides (largest first)."""
    out = [list(axes) for axes in spec]
    used = {a for axes in spec for a in axes}
    for a in active_axes(mesh):
        if a in used:
            continue
        for d in sorted(range(len(shape)), key=lambda d: -shape[d] // max(1, mesh.axis_size(out[d]))):
            have = mesh.axis_size(out[d])
            if (shape[d] // have) % mesh.shape[a] == 0 and shape[d] % have == 0:
                out[d].append(a)
                break
    return tuple(tuple(axes) for axes in out)


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


def _layer_cost(graph: Graph, layers: Layers, facts: LayerFacts, layer: int, lmesh: LogicalMesh,
                hardware: Hardware, options: PlanOptions, pinned: Mapping[int, Spec] | None = None) -> LayerCost:
    sub, ext = subgraph(graph, facts.ops, f"{layers.names[layer]}/", facts.param_grads, facts.exported)
    if not sub.ops:
        return LayerCost(0.0, 0.0, 0.0, 0.0, 0.0)
    cost = lmesh.cost_model(hardware)
    opts = dataclasses.replace(options, memory_budget=None, pipeline=False, tie_outputs=True,
                               inter_host_axes=lmesh.host_axes, hardware=hardware,
                               donate_argnums=())  # a layer's subgraph: no step arguments of its own
    pins = {j: pinned[t] for j, t in enumerate(ext) if pinned and t in pinned} or None
    refused = [v for v in (pins or {}).values() if isinstance(v, Exception)]
    if refused:  # a pinned leaf this mesh cannot hold as pinned
        log.info("layer %s on %s: %s", layers.names[layer], lmesh.mesh, refused[0])
        return INFEASIBLE
    try:
        plan = make_plan(sub, lmesh.mesh, opts, pins=pins, lp_level=2)  # small ILPs: see `ilp.solver.solve`
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
    act = 0.0
    for t in facts.saved:
        spec = produced_spec.get(t)
        act += shard_bytes(graph.tensors[t], spec, mesh) if spec is not None else graph.tensors[t].nbytes
    peak = float(plan.prediction.memory_bytes_per_device)
    work = max(0.0, peak - param_shard - act)
    apply_bytes = 2 * facts.state_bytes_total + facts.param_bytes_total
    apply_s = cost.compute_time(facts.apply_flops * ratio, apply_bytes * ratio, facts.apply_dtypes)
    # Sharded-state variant: store each parameter split over all axes, gather the plan's layout twice.
    zero_specs, zero_extra, zero_param, zero_gathers = [], 0.0, 0.0, []
    for j, t in enumerate(ext):
        spec = spec_of_input.get(t)
        if t not in param_set or spec is None:
            zero_specs.append(None)
            continue
        tensor = graph.tensors[t]
        z = zero_spec(tensor.shape, spec, mesh)
        zero_specs.append(z)
        zero_param += shard_bytes(tensor, z, mesh)
        extra_axes = tuple(sorted({a for axes in z for a in axes} - {a for axes in spec for a in axes}))
        if extra_axes:
            gathered = shard_bytes(tensor, spec, mesh)
            zero_extra += 2 * cost.collective_time("all-gather", gathered, extra_axes)
            gather = PredictedCollective("all-gather", tuple(mesh.axis_names[a] for a in extra_axes), gathered,
                                         mesh.axis_size(extra_axes),
                                         f"{layers.names[layer]} input {j} (forward and backward)", "sharded state")
            zero_gathers += [gather, gather]
    zratio = zero_param / facts.param_bytes_total if facts.param_bytes_total else 1.0 / mesh.size
    zero_state = 2 * zero_param + (facts.state_bytes_total - facts.param_bytes_total) * zratio
    data = batch_axes([spec_of_input.get(t) for t in ext if t not in param_set], mesh)
    sync, exposed = grad_sync(plan.prediction, data, cost)
    data_index = {mesh.axis_names.index(a) for a in data}
    if any(data_index & spec_axes(spec_of_input.get(t) or ()) for t in ext if t in param_set):
        # a parameter split over a data axis: the pipeline runtime reduces every microbatch
        # (`runtime.PipelinedStep._replicas`), as the layer's plan prices it; nothing once per step
        sync, exposed = 0.0, 0.0
    exported = set(sub.outputs)
    produced = {(op_index, k): spec for op_index, k, spec in plan.op_specs
                if sub.ops[op_index].outputs[k] in exported}
    pred = plan.prediction
    return LayerCost(pred.step_time_s - exposed, apply_s, state, act, work, facts.fwd_fraction,
                     tuple(spec_of_input.get(t) for t in ext), zero_extra, zero_state, work + param_shard,
                     tuple(zero_specs), sync, produced, max(0.0, pred.communication_time_s - exposed),
                     pred.hidden_communication_time_s, data, tuple(pred.collectives), tuple(zero_gathers))


def batch_axes(specs: Sequence[Spec | None], mesh) -> frozenset[str]:
    """Names of the mesh axes splitting dim 0 (the batch) of any of `specs` (the layer's inputs
    other than parameters: activations and batch leaves)."""
    return frozenset(mesh.axis_names[a] for spec in specs if spec for a in spec[0] if mesh.shape[a] > 1)


def grad_sync(prediction, data_axes: frozenset[str], cost) -> tuple[float, float]:
    """(its time, the part of it exposed in `prediction.step_time_s`) of the data-parallel gradient
    reduction of a plan (see the module docstring): the "partial sum" collectives over data axes only,
    priced combined as the ILP prices them."""
    axes_of = {n: i for i, n in enumerate(cost.mesh.axis_names)}
    groups: set[tuple[str, tuple[int, ...]]] = set()
    total = 0.0
    for c in prediction.collectives:
        if c.reason != "partial sum" or not c.axes or not set(c.axes) <= data_axes:
            continue
        axes = tuple(sorted(axes_of[a] for a in c.axes))
        total += cost.collective_time(c.kind, c.nbytes, axes, True)
        groups.add((c.kind, axes))
    total += sum(cost.collective_latency(kind, axes) for kind, axes in groups)
    hidden = float(getattr(prediction, "hidden_communication_time_s", 0.0) or 0.0)
    exposed = min(max(0.0, total - hidden), max(0.0, prediction.step_time_s - prediction.compute_time_s))
    return total, exposed


@dataclasses.dataclass(slots=True)
class LayerCostTable:
    """Costs of every layer on every logical mesh, planned once per distinct layer.

    `cost(layer, mesh_index)` is a LayerCost; `cache` maps (layer key, mesh shape, links, pinned
    specs) to it and may be shared between tables (e.g. for several microbatch sizes whose layers
    coincide). `pins(logical_mesh)`, when given, fixes the sharding of program inputs on that mesh
    ({tensor id: Spec}, e.g. a baseline's or the user's pins): each layer's ILP is planned with the
    pinned inputs it reads fixed, so a stage holding a pinned parameter keeps it as pinned; an
    exception in place of a Spec (a pin that mesh cannot take) makes the layers reading that input
    infeasible on that mesh.

    `variants` names further per-layer plans: name -> `pins(logical_mesh)` in the form above,
    each layer on that mesh planned again with the inputs it reads pinned so (`cost(layer, mesh_index,
    variant)`; "" is the layer's own plan, pinned by `pins` only). A variant whose pins map is empty on
    a mesh is not planned there (`has_variant`).
    """

    graph: Graph
    layers: Layers
    meshes: tuple[LogicalMesh, ...]
    cluster: Cluster
    options: PlanOptions
    cache: dict = dataclasses.field(default_factory=dict)
    facts: tuple[LayerFacts, ...] = ()
    solves: int = 0
    pins: Callable[[LogicalMesh], Mapping[int, Spec]] | None = None
    variants: Mapping[str, Callable[[LogicalMesh], Mapping[int, Spec]]] = dataclasses.field(default_factory=dict)
    _pinned: dict = dataclasses.field(default_factory=dict)
    _inner: dict = dataclasses.field(default_factory=dict)
    _edges: tuple | None = None
    _inputs: dict = dataclasses.field(default_factory=dict)  # layer -> its `external_inputs`

    def __post_init__(self):
        if not self.facts:
            self.facts = layer_facts(self.graph, self.layers)

    def inner(self, mesh_index: int, variant: str = "") -> np.ndarray:
        """`out[k, i]`: seconds per microbatch spent resharding values passed between layers k..i
        when they run in one stage on that mesh (meaningful for i >= k).

        Each layer's plan chooses the layout it reads its inputs in and the layout it makes its
        outputs in; where a value made by layer l is read by a later layer c of the same stage in
        another layout, the stage reshards it in the forward and its gradient (the same bytes, the
        other way) in the backward: twice `reshard_cost` of the value on the stage's logical mesh
        (the one pricing of resharding the intra-op ILP uses). Values crossing a stage boundary are
        the send's business (`stage_ranges`)."""
        if (mesh_index, variant) in self._inner:
            return self._inner[mesh_index, variant]
        if self._edges is None:
            self._edges = layer_edges(self.graph, self.layers, self.facts)
        L = self.layers.num_layers
        pair = np.zeros((L, L))
        cost = self.meshes[mesh_index].cost_model(effective_hardware(self.cluster))
        for l, key, c, j, t in self._edges:
            made, read = self.cost(l, mesh_index, variant), self.cost(c, mesh_index, variant)
            src = made.produced_specs.get(key)
            dst = read.input_specs[j] if j < len(read.input_specs) else None
            if src is None or dst is None or src == dst:
                continue
            pair[l, c] += 2 * reshard_cost(self.graph.tensors[t], src, dst, cost)[1]
        # out[k, i] = sum over k <= l < c <= i of pair[l, c]
        out = np.flip(np.cumsum(np.flip(np.cumsum(pair, axis=1), axis=0), axis=0), axis=0)
        self._inner[mesh_index, variant] = out
        return out

    def _pins_on(self, mesh_index: int, variant: str) -> Mapping[int, Spec]:
        if (variant, mesh_index) not in self._pinned:
            source = self.pins if not variant else self.variants[variant]
            self._pinned[variant, mesh_index] = {} if source is None else dict(source(self.meshes[mesh_index]))
        return self._pinned[variant, mesh_index]

    def has_variant(self, variant: str, mesh_index: int) -> bool:
        """Whether the variant is planned on that mesh ("": always; a named one: its pins say something)."""
        return not variant or bool(self._pins_on(mesh_index, variant))

    def pinned(self, layer: int, mesh_index: int, variant: str = "") -> tuple[Mapping[int, Spec], tuple]:
        """The pinned inputs the layer reads on that mesh ({tensor id: Spec}) and their specs in the
        layer's input order (part of the cache key: identical layers pinned alike share a plan)."""
        if self.pins is None and not variant:
            return {}, ()
        by_tensor = self._pins_on(mesh_index, variant)
        ext = self._inputs.get(layer)
        if ext is None:  # looked up on every `cost` of a pinned or variant layer
            ext = self._inputs[layer] = external_inputs(self.graph, self.facts[layer].ops)
        key = tuple(str(v) if isinstance(v, Exception) else by_tensor.get(t)
                    for t in ext for v in (by_tensor.get(t),))
        return by_tensor, (() if all(k is None for k in key) else key)

    def _key(self, layer: int, mesh_index: int, variant: str = "") -> tuple[tuple, Mapping[int, Spec]]:
        lm = self.meshes[mesh_index]
        pinned, pin_key = self.pinned(layer, mesh_index, variant)
        return (self.layers.keys[layer], lm.mesh.shape, lm.links, self.cluster.hardware.name, pin_key), pinned

    def _solve(self, layer: int, mesh_index: int, pinned: Mapping[int, Spec]) -> LayerCost:
        return _layer_cost(self.graph, self.layers, self.facts[layer], layer, self.meshes[mesh_index],
                           effective_hardware(self.cluster), self.options, pinned)

    def cost(self, layer: int, mesh_index: int, variant: str = "") -> LayerCost:
        key, pinned = self._key(layer, mesh_index, variant)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._solve(layer, mesh_index, pinned)
            self.solves += 1
        return hit

    def fill(self, mesh_indices: Sequence[int], threads: int | None = None, variants: Sequence[str] = ("",)) -> None:
        """Plans every distinct layer on each of `mesh_indices` (in each of `variants` the mesh has,
        `has_variant`) not planned yet, `threads` at once
        (None: the idle cores, `search.idle_cores`, divided by `options.solver_workers`). CP-SAT
        releases the GIL while it searches, so the solves run side by side; each is planned alone (one
        CP-SAT worker, deterministic limits), so the table is the one `cost` fills one by one."""
        todo: dict[tuple, tuple[int, int, Mapping[int, Spec]]] = {}
        for variant in variants:
            for mi in mesh_indices:
                if not self.has_variant(variant, mi):
                    continue
                for layer in range(self.layers.num_layers):
                    key, pinned = self._key(layer, mi, variant)
                    if key not in self.cache and key not in todo:
                        todo[key] = (layer, mi, pinned)
        if threads is None:
            threads = idle_cores() // max(1, self.options.solver_workers)
        threads = max(1, min(threads, len(todo)))
        if threads == 1:
            for key, (layer, mi, pinned) in todo.items():
                self.cache[key] = self._solve(layer, mi, pinned)
                self.solves += 1
            return
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = {key: pool.submit(self._solve, *job) for key, job in todo.items()}
            for key, future in futures.items():  # in submission order: the cache's order is the serial one's
                self.cache[key] = future.result()
                self.solves += 1


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


@dataclasses.dataclass(frozen=True, slots=True)
class StageOption:
    """One way to run a stage on a submesh: a logical mesh (index into the table's meshes), a state
    layout ("plan" or "sharded-state"), whether the backward recomputes the forward, and which
    per-layer plans it runs ("": each layer's own; else a `LayerCostTable.variants` name)."""

    mesh_index: int
    layout: str
    remat: bool
    variant: str = ""

    @property
    def name(self) -> str:
        """As `plan.stage_way` writes a stage, e.g. "fsdp:sharded-state+remat"."""
        return stage_way({"layer_plans": self.variant or "planned", "state_layout": self.layout, "remat": self.remat})


def stage_collectives(table: LayerCostTable, first: int, last: int, option: StageOption) -> tuple:
    """The collectives per microbatch of layers first..last run as `option` says: each layer's plan's
    (`LayerCost.collectives`) and, in the sharded-state layout, its parameter gathers
    (`LayerCost.zero_collectives`): what `stage_communication` and the stage times price."""
    out = []
    for layer in range(first, last + 1):
        cost = table.cost(layer, option.mesh_index, option.variant)
        out += cost.collectives
        if option.layout == "sharded-state":
            out += cost.zero_collectives
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class StageTimes:
    """Latency of every (layer range, submesh) for the DP, and how each was obtained.

    Attributes:
      times: `times[q, k, i, m]` seconds per microbatch of layers k..i on submesh m with
        `inflight[q]` microbatches in flight; infinity when nothing fits.
      option: index into `options[m]` of the way achieving it (-1: none).
      options: per submesh, the ways considered.
      inflight: in-flight microbatches of each q.
      boundary: activation bytes crossing each layer boundary per microbatch.
    """

    times: np.ndarray
    option: np.ndarray
    options: tuple[tuple[StageOption, ...], ...]
    inflight: tuple[int, ...]
    boundary: np.ndarray


def _range_sums(x: np.ndarray) -> np.ndarray:
    """`out[k, i] = sum(x[k..i])` for i >= k, infinity below the diagonal or over an infinite entry."""
    L = len(x)
    bad = ~np.isfinite(x)
    c = np.concatenate([[0.0], np.cumsum(np.where(bad, 0.0, x))])
    nbad = np.concatenate([[0], np.cumsum(bad)])
    out = c[None, 1:] - c[:-1, None]
    out[(nbad[None, 1:] - nbad[:-1, None]) > 0] = np.inf
    out[np.tril_indices(L, -1)] = np.inf
    return out


def _range_max(x: np.ndarray) -> np.ndarray:
    L = len(x)
    out = np.full((L, L), np.inf)
    for k in range(L):
        out[k, k:] = np.maximum.accumulate(x[k:])
    return out


def sync_every_microbatch(cost: LayerCost, option: StageOption) -> bool:
    """Whether the layer's data-parallel gradient reduction (`LayerCost.sync_s`) runs every
    microbatch as `option` runs it, not once per step: in the sharded-state layout its parameters
    are split over the data axes too, and the pipeline runtime then reduces every microbatch
    (`runtime.PipelinedStep._replicas`)."""
    return option.layout == "sharded-state" and bool(cost.data_axes) and cost.sync_s > 0


def _columns(table: LayerCostTable, option: StageOption) -> dict[str, np.ndarray]:
    """Per layer on the option's mesh, variant and state layout: its time per microbatch ("time")
    and the exposed communication inside it ("comm"), each with what remat's recomputed forward adds
    ("..._recompute"); its state, activation and working bytes."""
    rows = [table.cost(l, option.mesh_index, option.variant) for l in range(table.layers.num_layers)]
    sharded = option.layout == "sharded-state"
    gathers = [r.zero_extra_s if sharded else 0.0 for r in rows]  # the sharded state's all-gathers
    every = [r.sync_s if sync_every_microbatch(r, option) else 0.0 for r in rows]
    return {
        "time": np.array([r.time_s + g + e for r, g, e in zip(rows, gathers, every)]),
        "time_recompute": np.array([r.time_s * r.fwd_fraction + g / 2 for r, g in zip(rows, gathers)]),
        "comm": np.array([r.comm_s + g + e for r, g, e in zip(rows, gathers, every)]),
        "comm_recompute": np.array([r.comm_s * r.fwd_fraction + g / 2 for r, g in zip(rows, gathers)]),
        "state": np.array([r.zero_state_bytes if sharded else r.state_bytes for r in rows]),
        "act": np.array([r.act_bytes for r in rows]),
        "work": np.array([r.zero_work_bytes if sharded else r.work_bytes for r in rows]),
    }


def stage_ranges(table: LayerCostTable, option: StageOption, devices: int,
                 boundary: np.ndarray, link) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every layer range k..i: (latency per microbatch, fixed memory, memory per in-flight microbatch).

    The latency includes sending the stage's output activations forward and its input gradients
    backward (`alpha + bytes * beta / devices` each, over the cluster's boundary link), and the
    resharding of values passed between the range's layers (`LayerCostTable.inner`; once more in
    the recomputed forward under remat).
    """
    col = _columns(table, option)
    t = _range_seconds(table, col, "time", option, boundary, link, devices)
    state, act, work = _range_sums(col["state"]), _range_sums(col["act"]), _range_max(col["work"])
    if not option.remat:
        return t, state + work, act
    stage_input = np.concatenate([[0.0], boundary[:-1]]) / devices
    per_mb = np.where(np.isfinite(act), np.broadcast_to(stage_input[:, None], act.shape), np.inf)
    return t, state + act + work, per_mb


def _sends(boundary: np.ndarray, link, devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: the forward send after it (its stage ends there) and the backward send before it
    (its stage starts there), `alpha + bytes * beta / devices` over the boundary link."""
    send = np.array([link.alpha + b * link.beta / devices if b > 0 else 0.0 for b in boundary])
    fwd_send = send.copy()
    fwd_send[-1] = 0.0
    bwd_send = np.concatenate([[0.0], send[:-1]])
    return fwd_send, bwd_send


def _range_seconds(table: LayerCostTable, col: dict[str, np.ndarray], kind: str, option: StageOption,
                   boundary: np.ndarray, link, devices: int) -> np.ndarray:
    """`out[k, i]`: seconds per microbatch of layers k..i as one stage, from the per-layer column
    `kind` of `_columns` ("time", or "comm" for the communication inside it): the layers' sum, the
    resharding between them (`LayerCostTable.inner`), the boundary sends; under remat the
    recomputed forward's share of the layers and of the resharding."""
    inner = table.inner(option.mesh_index, option.variant)
    fwd_send, bwd_send = _sends(boundary, link, devices)
    out = _range_sums(col[kind]) + inner + fwd_send[None, :] + bwd_send[:, None]
    if option.remat:
        out = out + _range_sums(col[f"{kind}_recompute"]) + inner / 2
    return out


def stage_communication(table: LayerCostTable, first: int, last: int, option: StageOption, devices: int,
                        boundary: np.ndarray, link) -> tuple[float, float]:
    """(exposed, hidden) communication per microbatch inside the stage time `stage_ranges` gives for
    layers first..last (`_range_seconds` of the "comm" column)."""
    col = _columns(table, option)
    exposed = _range_seconds(table, col, "comm", option, boundary, link, devices)
    return float(exposed[first, last]), sum(table.cost(l, option.mesh_index, option.variant).hidden_s
                                            for l in range(first, last + 1))


def stage_times(table: LayerCostTable, submeshes: Sequence[tuple[int, int]],
                mesh_indices: Sequence[Sequence[int]], num_microbatches: int, schedule: str,
                memory_budget: float, boundary: np.ndarray, layouts: Sequence[str] = LAYOUTS,
                remats: Sequence[bool] = (False, True), variants: Sequence[str] | None = None) -> StageTimes:
    """The DP's latency table: per (layer range, submesh, in-flight count) the fastest way that fits.

    A way fits when `fixed + inflight * per_microbatch <= memory_budget` (see `stage_ranges`), where
    `inflight` is what a stage at that pipeline position holds: under 1F1B min(position from the
    end, B), under GPipe B. `layouts` and `remats` restrict the ways tried (a hand configuration
    fixes its state layout, and may fix recomputation); `variants` the per-layer plans (None: the
    layers' own and every one of `table.variants`).
    """
    L = table.layers.num_layers
    B = num_microbatches
    variants = ("", *table.variants) if variants is None else tuple(variants)
    table.fill(sorted({mi for idx in mesh_indices for mi in idx}), variants=variants)
    inflight = tuple(range(1, min(B, L) + 1)) if schedule == "1f1b" else (B,)
    Q, S = len(inflight), len(submeshes)
    times = np.full((Q, L, L, S), np.inf)
    option = np.full((Q, L, L, S), -1, dtype=np.int32)
    link = boundary_link(table.cluster)
    options: list[tuple[StageOption, ...]] = []
    for m, (n, k) in enumerate(submeshes):
        opts = tuple(StageOption(mi, layout, remat, v) for mi in mesh_indices[m] for v in variants
                     if table.has_variant(v, mi) for layout in layouts for remat in remats)
        options.append(opts)
        for j, opt in enumerate(opts):
            t, fixed, per_mb = stage_ranges(table, opt, n * k, boundary, link)
            for q, f in enumerate(inflight):
                ok = np.isfinite(t) & (fixed + f * per_mb <= memory_budget)
                cand = np.where(ok, t, np.inf)
                better = cand < times[q, :, :, m]
                times[q, :, :, m] = np.where(better, cand, times[q, :, :, m])
                option[q, :, :, m] = np.where(better, j, option[q, :, :, m])
    return StageTimes(times, option, tuple(options), inflight, boundary)


def stage_memory(table: LayerCostTable, first: int, last: int, opt: StageOption, devices: int,
                 boundary: np.ndarray, inflight: int) -> float:
    """Predicted per-device memory of one stage holding `inflight` microbatches."""
    _, fixed, per_mb = stage_ranges(table, opt, devices, boundary, boundary_link(table.cluster))
    return float(fixed[first, last] + inflight * per_mb[first, last])
