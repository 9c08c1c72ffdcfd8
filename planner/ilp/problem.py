"""The sharding problem of one graph on one mesh: nodes with strategies, resharding edges, liveness.

Shrinking happens here: an op with a single array operand (unary math, casts, transposes,
reshapes, broadcasts, reductions, slices) *follows* its operand: it adds no decision of its own,
its result's sharding is a function of the operand's, and its cost is folded into the strategy of
the node that owns the operand (Alpa's follower merging, `ilp.followers`). Only inputs, constants
and ops with several array operands (matmuls, binary math, gathers) become decisions; repeated layers
share them (`ilp.layer_sharing`). Liveness: `ilp.live_ranges`.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from planner.core.sharding import Spec, enumerate_specs
from planner.cost_model import CostModel
from planner.graph.fusion import attention_internal, fusions, recomputed
from planner.graph.ir import Graph, Literal, Tensor
from planner.ilp.followers import HEAVY, _followed, _followed_operand, _groups, _sig_key
from planner.ilp.layer_sharing import layer_representatives, structural_representatives
from planner.ilp.live_ranges import fused_away, live_ranges
from planner.ilp.nodes import Edge, Node
from planner.ilp.rules import RULES, signature
from planner.ilp.strategies import Quantized, edge_time, enumerate_strategies, int8_reads, shard_bytes
from planner.ilp.wire import wire_tensor

log = logging.getLogger("planner")

# Among otherwise equal plans, prefer the one that keeps fewer argument bytes per device
# (0.1 us per MiB: far below any collective, enough to break ties towards sharded inputs).
TIE_BREAK_S_PER_BYTE = 1e-13


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """Everything the solver needs, plus what is needed to turn a solution back into shardings."""

    graph: Graph
    cost: CostModel
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    owner: dict[int, int]
    ties: tuple[tuple[int, int], ...]
    live: tuple[tuple[int, int], ...]
    fallback_primitives: tuple[str, ...]
    free: frozenset[int]
    rep: tuple[int, ...]
    combinable: frozenset[int] = frozenset()
    overlap: bool = True  # combinable collectives run beside later compute (`ilp.objective`)
    prefetch: bool = False  # with overlap, arguments' resharding runs ahead of its consumers
    pinned_outputs: Mapping[int, Spec] = dataclasses.field(default_factory=dict)  # output -> layout handed back
    # Tensors XLA keeps inside one fusion (`fusion.fusions`: never written to memory); the memory
    # model leaves those of the optimizer update out (`ilp.liveness.memory_profile`).
    unwritten: frozenset[int] = frozenset()
    # Tensors XLA:CPU recomputes in each fusion that reads them (`fusion.recomputed`): no memory of
    # their own, their operands held until their last reader.
    recomputed: frozenset[int] = frozenset()
    # The XLA backend the plan compiles for ("cpu", "gpu", "tpu"; "" = the hardware preset's
    # platform): XLA:CPU allocates extra buffers for reductions (`ilp.liveness.memory_profile`).
    device_platform: str = ""
    # Host offload (`planner.ilp.offload`): (argument, its new value or -1) tensor pairs kept in the
    # host's memory between steps; `live` then holds their device ranges (`offloaded_live_ranges`)
    # and `ilp.objective` charges their transfers.
    offloaded: tuple[tuple[int, int], ...] = ()
    # Host-offloaded arguments read before the update (master parameters, by their casts to the
    # compute dtype, or a scanned stack's by each layer's cast of its slice): (argument, reading op,
    # share of the argument's bytes copied: 1, or one slice's) triples; each read copies that to the
    # device for that op alone (`ilp.liveness.memory_profile` counts it there, `ilp.objective`
    # charges the copy).
    host_reads: tuple[tuple[int, int, float], ...] = ()
    # Donated arguments (`PlanOptions.donate_argnums`): (argument, the new value that reuses its
    # buffer) tensor pairs; `live` ends such an argument at its last use (`live_ranges`).
    donated: tuple[tuple[int, int], ...] = ()
    # (weight, reading op) pairs gathered as int8 with block scales (`planner.ilp.wire`, comm_precision="int8")
    quantized: frozenset[tuple[int, int]] = frozenset()
    # (tensor type, producer's spec, consumer's spec) -> `strategies.edge_time`; repeated layers ask alike
    _edge_times: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # (tensor id, producer's spec, consumer's spec) -> the same seconds: a lookup that hashes no
    # `Tensor` (the coordinate descent and the decision records ask it most)
    _edge_times_by_id: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # `memory_bounds.memory_lower_bound` once computed (the mesh search bounds a mesh, then its solve checks it)
    _bounds: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # `liveness._borrowed` of the last plan asked (memory_profile, the memory rounds' cuts and the ILP
    # terms ask for the same plan in turn)
    _borrowed: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # `decided_live` once computed
    _decided: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def memory_platform(self) -> str:
        """The XLA backend whose memory the plan lives in: the devices', or the preset's without devices."""
        return self.device_platform or self.cost.hardware.platform

    def priced(self, tensor: int, op: int = -1) -> Tensor | Quantized:
        """What op `op`'s read of tensor `tensor` carries when resharded: the tensor's type, or its
        int8 payload where the plan gathers that weight quantised (`quantized`)."""
        t = self.graph.tensors[tensor]
        return Quantized(t, wire_tensor(t, self.cost.mesh.size)) if (tensor, op) in self.quantized else t

    def edge_time(self, tensor: int, src: Spec, dst: Spec, op: int = -1) -> float:
        """`strategies.edge_time` of tensor id `tensor` read by op `op` from `src` to `dst`, computed
        once per distinct question."""
        q = (tensor, op) in self.quantized
        found = self._edge_times_by_id.get((tensor, src, dst, q))
        if found is not None:
            return found
        t = self.priced(tensor, op)
        key = (t, src, dst)
        found = self._edge_times.get(key)
        if found is None:
            found = self._edge_times[key] = edge_time(t, src, dst, self.cost)
        self._edge_times_by_id[(tensor, src, dst, q)] = found
        return found

    def decided_live(self) -> tuple[tuple[int, tuple[int, int]], ...]:
        """(tensor id, live range) of each tensor a node decides, in tensor order: the ones the memory
        model can count (`liveness._materialised` needs a decision), without a pass over every tensor
        of the graph (a layer's subgraph keeps the whole step's tensor ids, most of them not its own)."""
        if not self._decided:
            self._decided["all"] = tuple((t, self.live[t]) for t in sorted(self.owner))
        return self._decided["all"]

    def spec(self, tensor: int, choice: Sequence[int]) -> Spec | None:
        """The tensor's sharding under `choice` (None for free tensors, which are left to XLA)."""
        node = self.owner.get(tensor)
        if node is None:
            return None
        return self.nodes[node].owned[tensor][choice[node]]


def _tensor_or_none(graph: Graph, x: int | Literal) -> Tensor | None:
    return None if isinstance(x, Literal) else graph.tensors[x]


@dataclasses.dataclass(frozen=True, slots=True)
class _Inputs:
    """What every op's step reads: `build_problem`'s arguments and the graph's fusions."""

    graph: Graph
    cost: CostModel
    rules: Any
    allowed: Mapping[int, frozenset[Spec]] | None
    combinable: set[int]
    memory_traffic: Any  # `fusions(graph, cost.hardware.platform)`, per op


@dataclasses.dataclass(frozen=True, slots=True)
class _Decisions:
    """The decisions built so far, filled in place op by op in program order, and the answers that
    repeated layers share (each distinct (signature, types, spec) question is answered once; the
    ILPs priced with one cost model share them too, `CostModel.answers`)."""

    nodes: list[Node]
    owner: dict[int, int]
    free: set[int]
    fallback: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)  # (primitive, why) -> ops replicated
    extra_edges: list[tuple[int, int, list[Spec], int, int]] = dataclasses.field(default_factory=list)
    followed: dict[tuple, tuple] = dataclasses.field(default_factory=dict)
    per_spec: dict[tuple, tuple] = dataclasses.field(default_factory=dict)  # (question, one lead spec) -> `_followed`
    enumerated: dict[tuple, tuple] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    """One op as its step reads it."""

    op: Any
    sig: Any
    ins: list[Tensor | None]
    outs: list[Tensor]
    arrays: list[int]  # positions of array operands
    scalars: list[int]  # positions of scalar operands
    combined: bool  # in `combinable_ops`
    traffic: tuple  # the op's (reads, writes charged, FLOP share) under the preset's fusions (`fusion.Traffic.charged`)


def build_problem(graph: Graph, cost: CostModel, rules=RULES, tie_outputs: bool = True,
                  share_layers: bool = True, pins: Mapping[int, Spec] | None = None,
                  donated_inputs: frozenset[int] = frozenset(), device_platform: str = "",
                  allowed: Mapping[int, frozenset[Spec]] | None = None) -> Problem:
    """Builds nodes (with follower merging), edges, output ties and tensor live ranges.

    Tensors computed from literals alone (iotas, broadcast zeros, masks) are *free*: any device
    can make any shard of them locally, so they carry no decision and no resharding cost.

    `pins` (input tensor id -> spec, `planner.configs.pins`) leave a pinned input's decision that one
    strategy; its followers follow it. Layer sharing compares strategies, so a pinned input shares
    a decision only with inputs pinned alike, and an unpinned layer's input keeps all of its own.

    `donated_inputs` (argument tensor ids whose buffers the program may reuse, as
    `jax.jit(donate_argnums=...)`): each is paired with the output of the same pytree path and type,
    which comes back in the same layout (a tie or a pinned output), so XLA writes it into the
    argument's buffer (JAX pairs donated arguments with outputs of equal type and sharding in order;
    for a train state's leaves that is this pairing); `live_ranges` frees the argument at its last use.

    `share_layers`: repeated layers share one decision, found by their indexed module names
    (`layer_representatives`) or, when the names show none, by structure
    (`structural_representatives`).

    `device_platform`: the XLA backend the program compiles for ("" = the hardware preset's): time
    follows the preset's fusion rules, the update values never written to memory (`unwritten`)
    follow that backend's (`planner.graph.fusion`).

    `allowed` (tensor id -> specs) restricts the search to a neighbourhood (`search.refinement.neighbourhood`):
    an argument takes only its allowed specs, an op that decides (not a follower) only the
    strategies making every result in an allowed spec and, of those, the ones reading every
    operand in an allowed spec (each filter dropped when nothing passes it); followers follow their
    lead as always. Tensors not in it are unrestricted.
    """
    pins = pins or {}
    # the answers to each distinct question depend on it and the cost model alone: the ILPs priced with
    # one model share them (under the default rules; a caller's own rules keep their own)
    followed, per_spec, enumerated = cost.answers.setdefault("build_problem", ({}, {}, {})) if rules is RULES \
        else ({}, {}, {})
    built = _Decisions([], {}, set(graph.consts), followed=followed, per_spec=per_spec, enumerated=enumerated)
    _input_nodes(built, graph, cost, pins, allowed)
    inputs = _Inputs(graph, cost, rules, allowed, graph.cached(("combinable",), lambda: combinable_ops(graph)),
                     fusions(graph, cost.hardware.platform))
    for op in graph.ops:
        _add_op(inputs, built, op)
    nodes, owner = built.nodes, built.owner
    edges = _edges(built)
    ties: list[tuple[int, int]] = []
    donated: list[tuple[int, int]] = []
    pinned_outputs: dict[int, Spec] = {}
    if tie_outputs:
        ties, donated, pinned_outputs = _output_ties(graph, built, pins, donated_inputs, edges)
    ties.extend((a, b) for a, b in graph.loop_ties if a in owner and b in owner)
    warned = graph.cached(("fallbacks_warned",), set)  # once per graph, not once per mesh or lever solve
    for (name, why), n in sorted(built.fallback.items()):
        if (name, why) in warned:
            continue
        warned.add((name, why))
        if why:
            log.warning("%s (%d ops): planned replicated: %s", name, n, why)
        else:
            log.warning("no sharding rule for primitive %r (%d ops): planned replicated", name, n)
    unwritten, again, live, rep = _memory_and_sharing(inputs, nodes, edges, donated, device_platform, share_layers)
    return Problem(graph, cost, tuple(nodes), tuple(edges), owner, tuple(ties), live,
                   tuple(sorted({name for name, _ in built.fallback})), frozenset(built.free), rep, frozenset(inputs.combinable),
                   pinned_outputs=pinned_outputs, donated=tuple(donated), unwritten=unwritten,
                   recomputed=again, device_platform=device_platform, quantized=int8_reads(graph, cost))


def _input_nodes(built: _Decisions, graph: Graph, cost: CostModel, pins: Mapping[int, Spec],
                 allowed: Mapping[int, frozenset[Spec]] | None) -> None:
    """One decision per argument: its specs (the pinned one, else every spec, narrowed to `allowed`),
    each costing the tie-break of the bytes it keeps per device."""
    for tid, path in zip(graph.inputs, graph.input_paths):
        t = graph.tensors[tid]
        specs = [pins[tid]] if tid in pins else list(enumerate_specs(t.shape, cost.mesh))
        if allowed and tid in allowed and tid not in pins:
            specs = [s for s in specs if s in allowed[tid]] or specs
        keep = [TIE_BREAK_S_PER_BYTE * shard_bytes(t, s, cost.mesh) for s in specs]
        built.nodes.append(Node(len(built.nodes), f"input {path}", keep, [[] for _ in specs], {tid: specs}, [],
                                [], ["" for _ in specs]))
        built.owner[tid] = len(built.nodes) - 1


def _add_op(inputs: _Inputs, built: _Decisions, op) -> None:
    """Op `op`'s part of the problem: nothing (a free result), a follower of its lead operand's
    decision, or a decision of its own."""
    graph = inputs.graph
    sig = signature(op, graph, inputs.rules)
    if not sig.known:
        key = (op.name, sig.fallback)
        built.fallback[key] = built.fallback.get(key, 0) + 1
    tensors_in = [x for x in op.inputs if isinstance(x, int)]
    if all(x in built.free for x in tensors_in) and sig.known:
        built.free.update(op.outputs)
        return
    seen = _Op(op, sig, [_tensor_or_none(graph, x) for x in op.inputs], [graph.tensors[t] for t in op.outputs],
               [k for k, x in enumerate(op.inputs) if isinstance(x, int) and graph.tensors[x].shape],
               [k for k, x in enumerate(op.inputs) if isinstance(x, int) and not graph.tensors[x].shape],
               op.index in inputs.combinable,
               inputs.memory_traffic[op.index].charged)
    lead = _followed_operand(op, sig, graph, built.free, seen.arrays)
    if lead is not None:
        _merge_follower(inputs, built, seen, lead)
        return
    node = _decision_node(inputs, built, seen)
    built.nodes.append(node)
    for t in op.outputs:
        built.owner[t] = node.index


def _merge_follower(inputs: _Inputs, built: _Decisions, seen: _Op, lead: int) -> None:
    """Folds a follower op into the node deciding its `lead` operand: its costs, collectives and
    result spec per strategy of that node, and edges for its other operands."""
    op, combined = seen.op, seen.combined
    src = op.inputs[lead]
    node = built.nodes[built.owner[src]]
    others = [k for k in seen.arrays if k != lead]
    question = (_sig_key(seen.sig), lead, tuple(seen.ins), tuple(seen.outs), combined, seen.traffic, tuple(others))
    key = (question, tuple(node.owned[src]))
    found = built.followed.get(key)
    if found is None:
        found = built.followed[key] = _followed(seen.sig, lead, node.owned[src], seen.ins, seen.outs, inputs.cost,
                                                combined, seen.traffic, others, built.per_spec, question)
    node.costs[:] = [c + add for c, add in zip(node.costs, found.costs)]
    if any(found.comm_s):  # most followers communicate in no strategy
        node.comm_s[:] = [c + add for c, add in zip(node.comm_s, found.comm_s)]
    if combined and any(found.groups):
        node.combined[:] = [c | g for c, g in zip(node.combined, found.groups)]
    if combined and any(found.async_s):
        node.async_s[:] = [c + add for c, add in zip(node.async_s, found.async_s)]
    for i, comms, times in found.comms:
        node.comms[i].extend(comms)
        node.comm_ops[i].extend([op.index] * len(comms))
        node.comm_times[i].extend(times)
    out_specs = list(found.out_specs)
    needs = {k: list(v) for k, v in found.needs.items()}
    for k in others:
        if op.inputs[k] in built.free:
            node.free_requires.append((op.inputs[k], needs[k]))
        else:
            built.extra_edges.append((op.inputs[k], node.index, needs[k], op.index, k))
    node.owned[op.outputs[0]] = out_specs
    node.ops.append(op.index)
    built.owner[op.outputs[0]] = node.index


def _strategies(inputs: _Inputs, built: _Decisions, seen: _Op) -> tuple:
    """(strategies, their descriptions, collective seconds, combined groups, per operand its spec per
    strategy) of a deciding op, narrowed to `allowed`; computed once per distinct question."""
    op, combined, allowed, cost = seen.op, seen.combined, inputs.allowed, inputs.cost
    near = tuple(allowed.get(t) for t in op.outputs) if allowed else ()
    reads = tuple(allowed.get(x) if isinstance(x, int) else None for x in op.inputs) if allowed else ()
    key = (_sig_key(seen.sig), tuple(seen.ins), tuple(seen.outs), op.name in HEAVY, combined, seen.traffic, near, reads)
    if key not in built.enumerated:
        found = enumerate_strategies(seen.sig, seen.ins, seen.outs, cost, full_split_only=op.name in HEAVY,
                                     combined=combined, traffic=seen.traffic)
        if any(a is not None for a in near):  # results near, operands near too where some such strategy is
            found = [s for s in found if all(a is None or o in a for o, a in zip(s.out_specs, near))] or found
            found = [s for s in found if all(a is None or i is None or i in a
                                             for i, a in zip(s.in_specs, reads))] or found
        built.enumerated[key] = (found, [s.describe(cost.mesh) for s in found],
                                 [[cost.collective_time(kd, b, a, combined) for kd, a, b in s.comms] for s in found],
                                 [_groups(s.comms) if combined else frozenset() for s in found],
                                 [[s.in_specs[k] for s in found] for k in range(len(op.inputs))])
    return built.enumerated[key]


def _decision_node(inputs: _Inputs, built: _Decisions, seen: _Op) -> Node:
    """The node of an op that decides its own strategy (not a follower)."""
    op, free, combined = seen.op, built.free, seen.combined
    strategies, descriptions, comm_times, groups, in_specs = _strategies(inputs, built, seen)
    return Node(
        index=len(built.nodes),
        label=f"{op.name} {op.name_stack}".strip(),
        costs=[s.cost for s in strategies],
        comms=[list(s.comms) for s in strategies],
        owned={t: [s.out_specs[j] for s in strategies] for j, t in enumerate(op.outputs)},
        requires=[(op.inputs[k], in_specs[k], k) for k in seen.arrays if op.inputs[k] not in free]
        + [(op.inputs[k], [() for _ in strategies], k) for k in seen.scalars if op.inputs[k] not in free],
        ops=[op.index],
        descriptions=list(descriptions),
        free_requires=[(op.inputs[k], in_specs[k]) for k in seen.arrays if op.inputs[k] in free],
        comm_s=[s.comm_time for s in strategies],
        comm_times=[list(ts) for ts in comm_times],
        combined=list(groups),
        async_s=[s.comm_time if combined else 0.0 for s in strategies],
        quantise_s=[s.quantise_time if combined else 0.0 for s in strategies],
    )


def _edges(built: _Decisions) -> list[Edge]:
    """An edge per operand a node reads from another's tensor: root ops' operands, then followers'."""
    nodes, owner = built.nodes, built.owner
    edges = []
    for node in nodes:
        for tid, req, k in node.requires:
            src = owner[tid]
            edges.append(Edge(src, node.index, tid, tuple(nodes[src].owned[tid]), tuple(req), node.ops[0], k))
    for tid, dst, req, op_index, k in built.extra_edges:
        src = owner[tid]
        edges.append(Edge(src, dst, tid, tuple(nodes[src].owned[tid]), tuple(req), op_index, k))
    return edges


def _output_ties(graph: Graph, built: _Decisions, pins: Mapping[int, Spec], donated_inputs: frozenset[int],
                 edges: list[Edge]) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[int, Spec]]:
    """(ties, donated pairs, pinned outputs): each output of an argument's pytree path and type comes
    back in that argument's layout, tied to it or (a pinned argument) resharded to its pin by an
    edge appended to `edges`."""
    nodes, owner = built.nodes, built.owner
    ties: list[tuple[int, int]] = []
    donated: list[tuple[int, int]] = []
    pinned_outputs: dict[int, Spec] = {}
    by_path = {p: t for p, t in zip(graph.input_paths, graph.inputs)}
    for path, out in zip(graph.output_paths, graph.outputs):
        tin = by_path.get(path)
        if (isinstance(out, int) and tin is not None and out != tin and out in owner
                and graph.tensors[out] == graph.tensors[tin]):
            if tin in donated_inputs and all(tin != a for a, _ in donated):
                donated.append((tin, out))
            if tin in pins:
                # A pinned state leaf comes back in its pinned layout, as `jax.jit(out_shardings=...)`
                # would hand it back: the output may be computed in another layout and resharded
                # at the end (an edge into the pinned input's node), never made infeasible.
                src, dst = owner[out], owner[tin]
                edges.append(Edge(src, dst, out, tuple(nodes[src].owned[out]), tuple(nodes[dst].owned[tin])))
                pinned_outputs[out] = pins[tin]
            else:
                ties.append((tin, out))
    return ties, donated, pinned_outputs


def _memory_and_sharing(inputs: _Inputs, nodes: list[Node], edges: list[Edge], donated: list[tuple[int, int]],
                        device_platform: str, share_layers: bool) -> tuple:
    """(unwritten values, recomputed values, live ranges, layer sharing's representatives)."""
    graph, cost = inputs.graph, inputs.cost
    rep = tuple(range(len(nodes)))
    # time is the preset's, memory the devices' the program compiles for: their XLA fuses the update
    # (which values it never writes) by its own rules
    memory_platform = device_platform or cost.hardware.platform  # as `Problem.memory_platform`
    unwritten_by = (inputs.memory_traffic if memory_platform == cost.hardware.platform
                    else fusions(graph, memory_platform))
    if share_layers:
        rep = layer_representatives(nodes, graph)
        if len(set(rep)) == len(rep):  # no repeated layers by name: find them by structure
            rep = structural_representatives(nodes, graph, edges)
    unwritten, again, live = graph.cached(("memory_facts", memory_platform, cost.hardware.platform, tuple(donated)),
                                          lambda: _memory_facts(graph, unwritten_by, inputs.combinable, memory_platform,
                                                                donated))
    return unwritten, again, live, rep


def _memory_facts(graph: Graph, unwritten_by, combinable: set[int], memory_platform: str,
                  donated: list[tuple[int, int]]) -> tuple:
    """(unwritten values, recomputed values, live ranges): the graph's alone, given the platforms and
    the donation pairs (every mesh's problem of one graph asks again)."""
    unwritten = frozenset(t for op in graph.ops for t, w in zip(op.outputs, unwritten_by[op.index].writes) if not w)
    again = recomputed(graph, memory_platform) | attention_internal(graph, memory_platform)
    live = live_ranges(graph, donated, fused_away(graph, unwritten, combinable, memory_platform, again))
    return unwritten, again, live


def combinable_ops(graph: Graph) -> set[int]:
    """Ops whose results feed no matmul: their reductions (gradient reductions, in a train step)
    are independent of each other and get merged by XLA's combiner passes."""
    feeds_heavy = [False] * len(graph.tensors)
    out: set[int] = set()
    for op in reversed(graph.ops):
        reaches = any(feeds_heavy[t] for t in op.outputs)
        if not reaches:
            out.add(op.index)
        if reaches or op.name in HEAVY:
            for x in op.inputs:
                if isinstance(x, int):
                    feeds_heavy[x] = True
    return out


