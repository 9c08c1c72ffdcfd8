"""The sharding problem of one graph on one mesh: nodes with strategies, resharding edges, liveness.

Shrinking happens here: an op with a single array operand (unary math, casts, transposes,
reshapes, broadcasts, reductions, slices) *follows* its operand: it adds no decision of its own,
its result's sharding is a function of the operand's, and its cost is folded into the strategy of
the node that owns the operand (Alpa's follower merging). Only inputs, constants and ops with
several array operands (matmuls, binary math, gathers) become decisions.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from planner.cost_model import CostModel
from planner.graph.trace import Graph, Literal, Tensor
from planner.ilp.rules import ELEMENTWISE, RULES, signature
from planner.graph.fusion import fusions, recomputed
from planner.ilp.strategies import Comm, Strategy, edge_time, enumerate_strategies, follow, shard_bytes
from planner.core.layer_index import find_indexed, star_indices
from planner.core.sharding import Spec, enumerate_specs

log = logging.getLogger("planner")

# Among otherwise equal plans, prefer the one that keeps fewer argument bytes per device
# (0.1 us per MiB: far below any collective, enough to break ties towards sharded inputs).
TIE_BREAK_S_PER_BYTE = 1e-13
HEAVY = frozenset({"dot_general", "conv_general_dilated"})
# Multi-operand ops that follow their first operand; the others are resharded to match.
FOLLOW_FIRST = frozenset(ELEMENTWISE)


@dataclasses.dataclass(slots=True)
class Node:
    """One decision of the ILP: pick one of `costs` (one entry per strategy).

    Attributes:
      index: position in `Problem.nodes`.
      label: what the node is (input path or op name and module path).
      costs: seconds per strategy (own compute + own collectives + those of its followers).
      comms: collectives per strategy (for predictions and explanations).
      owned: tensor id -> spec per strategy, for every tensor whose sharding this node decides.
      requires: (tensor id, required spec per strategy, operand position) for each array operand of
        the root op.
      ops: op indices decided by this node (root op first, then followers).
      descriptions: per strategy, the root op's strategy in words.
      free_requires: (free tensor id, spec per strategy) wanted of free operands (iotas, masks), so
        emission can materialise them directly in the layout their consumers use.
      comm_s: per strategy, the seconds of `costs` that are its own collectives (the rest is compute).
      comm_times: per strategy, the seconds of each entry of `comms` as `costs` counts it (they sum
        to `comm_s`); decision records carry them.
      combined: per strategy, the (kind, axes) groups its combinable collectives join; each group's
        latency is paid once per step (`ilp.objective`), not per collective.
      async_s: per strategy, the seconds of `comm_s` that XLA's latency-hiding scheduler can run
        beside later compute (the combinable collectives: gradient reductions).
      comm_ops: per strategy, the op index that performs each entry of `comms` (the memory model
        places a reduction's buffers at its op, `ilp.solver.memory_profile`).
    """

    index: int
    label: str
    costs: list[float]
    comms: list[list[Comm]]
    owned: dict[int, list[Spec]]
    requires: list[tuple[int, list[Spec], int]]
    ops: list[int]
    descriptions: list[str]
    free_requires: list[tuple[int, list[Spec]]] = dataclasses.field(default_factory=list)
    comm_s: list[float] = dataclasses.field(default_factory=list)
    combined: list[frozenset[tuple[str, tuple[int, ...]]]] = dataclasses.field(default_factory=list)
    comm_times: list[list[float]] = dataclasses.field(default_factory=list)
    async_s: list[float] = dataclasses.field(default_factory=list)
    comm_ops: list[list[int]] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.comm_ops:
            self.comm_ops = [[self.ops[0] if self.ops else -1] * len(c) for c in self.comms]
        if not self.async_s:
            self.async_s = [0.0] * len(self.costs)
        if not self.comm_times:
            self.comm_times = [[0.0] * len(c) for c in self.comms]
        if not self.comm_s:
            self.comm_s = [0.0] * len(self.costs)
        if not self.combined:
            self.combined = [frozenset()] * len(self.costs)

    @property
    def size(self) -> int:
        return len(self.costs)


@dataclasses.dataclass(frozen=True, slots=True)
class Edge:
    """Tensor `tensor` produced under node `src`'s choice and read as operand `pos` of op `op` under
    node `dst`'s choice (op -1: a pinned output handed back in the layout of input node `dst`)."""

    src: int
    dst: int
    tensor: int
    src_specs: tuple[Spec, ...]
    dst_specs: tuple[Spec, ...]
    op: int = -1
    pos: int = -1


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
    # model leaves those of the optimizer update out (`ilp.solver.memory_profile`).
    unwritten: frozenset[int] = frozenset()
    # Tensors XLA:CPU recomputes in each fusion that reads them (`fusion.recomputed`): no memory of
    # their own, their operands held until their last reader.
    recomputed: frozenset[int] = frozenset()
    # The XLA backend the plan compiles for ("cpu", "gpu", "tpu"; "" = the hardware preset's
    # platform): XLA:CPU allocates extra buffers for reductions (`ilp.solver.memory_profile`).
    device_platform: str = ""
    # Host offload (`planner.ilp.offload`): (argument, its new value or -1) tensor pairs kept in the
    # host's memory between steps; `live` then holds their device ranges (`offloaded_live_ranges`)
    # and `ilp.objective` charges their transfers.
    offloaded: tuple[tuple[int, int], ...] = ()
    # Host-offloaded arguments read before the update (master parameters, by their casts to the
    # compute dtype): (argument, reading op) pairs; each read copies the argument to the device for
    # that op alone (`ilp.solver.memory_profile` counts it there, `ilp.objective` charges the copy).
    host_reads: tuple[tuple[int, int], ...] = ()
    # Donated arguments (`PlanOptions.donate_argnums`): (argument, the new value that reuses its
    # buffer) tensor pairs; `live` ends such an argument at its last use (`live_ranges`).
    donated: tuple[tuple[int, int], ...] = ()
    # (tensor type, producer's spec, consumer's spec) -> `strategies.edge_time`; repeated layers ask alike
    _edge_times: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # (tensor id, producer's spec, consumer's spec) -> the same seconds: a lookup that hashes no
    # `Tensor` (the coordinate descent and the decision records ask ~300k times on gpt2-small 2x4)
    _edge_times_by_id: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # `solver.memory_lower_bound` once computed (the mesh search bounds a mesh, then its solve checks it)
    _bounds: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    # `solver._borrowed` of the last plan asked (memory_profile, the memory rounds' cuts and the ILP
    # terms ask for the same plan in turn)
    _borrowed: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def memory_platform(self) -> str:
        """The XLA backend whose memory the plan lives in: the devices', or the preset's without devices."""
        return self.device_platform or self.cost.hardware.platform

    def edge_time(self, tensor: int, src: Spec, dst: Spec) -> float:
        """`strategies.edge_time` of tensor id `tensor` from `src` to `dst`, computed once per distinct question."""
        found = self._edge_times_by_id.get((tensor, src, dst))
        if found is not None:
            return found
        t = self.graph.tensors[tensor]
        key = (t, src, dst)
        found = self._edge_times.get(key)
        if found is None:
            found = self._edge_times[key] = edge_time(t, src, dst, self.cost)
        self._edge_times_by_id[(tensor, src, dst)] = found
        return found

    def spec(self, tensor: int, choice: Sequence[int]) -> Spec | None:
        """The tensor's sharding under `choice` (None for free tensors, which are left to XLA)."""
        node = self.owner.get(tensor)
        if node is None:
            return None
        return self.nodes[node].owned[tensor][choice[node]]


def _tensor_or_none(graph: Graph, x: int | Literal) -> Tensor | None:
    return None if isinstance(x, Literal) else graph.tensors[x]


def _followed_operand(op, sig, graph: Graph, free: set[int], arrays: list[int]) -> int | None:
    """The operand an op follows, or None when the op is a decision of its own."""
    if len(op.outputs) != 1 or op.name in HEAVY:
        return None
    live = [k for k in arrays if op.inputs[k] not in free and sig.inputs[k] is not None]
    if not live:
        return None
    if len([k for k in arrays if op.inputs[k] not in free]) == 1 or op.name in FOLLOW_FIRST:
        return live[0]
    return None


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

    `allowed` (tensor id -> specs) restricts the search to a neighbourhood (`search.neighbourhood`):
    an argument takes only its allowed specs, an op that decides (not a follower) only the
    strategies making every result in an allowed spec and, of those, the ones reading every
    operand in an allowed spec (each filter dropped when nothing passes it); followers follow their
    lead as always. Tensors not in it are unrestricted.
    """
    pins = pins or {}
    nodes: list[Node] = []
    owner: dict[int, int] = {}
    fallback: dict[str, int] = {}
    free: set[int] = set(graph.consts)
    extra_edges: list[tuple[int, int, list[Spec], int, int]] = []

    for tid, path in zip(graph.inputs, graph.input_paths):
        t = graph.tensors[tid]
        specs = [pins[tid]] if tid in pins else list(enumerate_specs(t.shape, cost.mesh))
        if allowed and tid in allowed and tid not in pins:
            specs = [s for s in specs if s in allowed[tid]] or specs
        keep = [TIE_BREAK_S_PER_BYTE * shard_bytes(t, s, cost.mesh) for s in specs]
        nodes.append(Node(len(nodes), f"input {path}", keep, [[] for _ in specs], {tid: specs}, [],
                          [], ["" for _ in specs]))
        owner[tid] = len(nodes) - 1

    combinable = combinable_ops(graph)
    memory_traffic = fusions(graph, cost.hardware.platform)
    # Repeated layers repeat the same (signature, types, spec) questions: each is answered once.
    followed: dict[tuple, tuple] = {}
    per_spec: dict[tuple, tuple] = {}  # (question, one lead spec) -> its answer (`_followed`)
    enumerated: dict[tuple, tuple[list[Strategy], list[str], list[list[float]]]] = {}
    for op in graph.ops:
        sig = signature(op, graph, rules)
        combined = op.index in combinable
        if not sig.known:
            fallback[op.name] = fallback.get(op.name, 0) + 1
        tensors_in = [x for x in op.inputs if isinstance(x, int)]
        if all(x in free for x in tensors_in) and sig.known:
            free.update(op.outputs)
            continue
        ins = [_tensor_or_none(graph, x) for x in op.inputs]
        outs = [graph.tensors[t] for t in op.outputs]
        arrays = [k for k, x in enumerate(op.inputs) if isinstance(x, int) and graph.tensors[x].shape]
        scalars = [k for k, x in enumerate(op.inputs) if isinstance(x, int) and not graph.tensors[x].shape]
        lead = _followed_operand(op, sig, graph, free, arrays)
        if lead is not None:
            src = op.inputs[lead]
            node = nodes[owner[src]]
            others = [k for k in arrays if k != lead]
            traffic = (memory_traffic[op.index].reads, memory_traffic[op.index].writes)
            question = (_sig_key(sig), lead, tuple(ins), tuple(outs), combined, traffic, tuple(others))
            key = (question, tuple(node.owned[src]))
            found = followed.get(key)
            if found is None:
                found = followed[key] = _followed(sig, lead, node.owned[src], ins, outs, cost, combined, traffic,
                                                  others, per_spec, question)
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
                if op.inputs[k] in free:
                    node.free_requires.append((op.inputs[k], needs[k]))
                else:
                    extra_edges.append((op.inputs[k], node.index, needs[k], op.index, k))
            node.owned[op.outputs[0]] = out_specs
            node.ops.append(op.index)
            owner[op.outputs[0]] = node.index
            continue
        traffic = (memory_traffic[op.index].reads, memory_traffic[op.index].writes)
        near = tuple(allowed.get(t) for t in op.outputs) if allowed else ()
        reads = tuple(allowed.get(x) if isinstance(x, int) else None for x in op.inputs) if allowed else ()
        key = (_sig_key(sig), tuple(ins), tuple(outs), op.name in HEAVY, combined, traffic, near, reads)
        if key not in enumerated:
            found = enumerate_strategies(sig, ins, outs, cost, full_split_only=op.name in HEAVY, combined=combined,
                                         traffic=traffic)
            if any(a is not None for a in near):  # results near, operands near too where some such strategy is
                found = [s for s in found if all(a is None or o in a for o, a in zip(s.out_specs, near))] or found
                found = [s for s in found if all(a is None or i is None or i in a
                                                 for i, a in zip(s.in_specs, reads))] or found
            enumerated[key] = (found, [s.describe(cost.mesh) for s in found],
                               [[cost.collective_time(kd, b, a, combined) for kd, a, b in s.comms] for s in found],
                               [_groups(s.comms) if combined else frozenset() for s in found],
                               [[s.in_specs[k] for s in found] for k in range(len(op.inputs))])
        strategies, descriptions, comm_times, groups, in_specs = enumerated[key]
        node = Node(
            index=len(nodes),
            label=f"{op.name} {op.name_stack}".strip(),
            costs=[s.cost for s in strategies],
            comms=[list(s.comms) for s in strategies],
            owned={t: [s.out_specs[j] for s in strategies] for j, t in enumerate(op.outputs)},
            requires=[(op.inputs[k], in_specs[k], k) for k in arrays if op.inputs[k] not in free]
            + [(op.inputs[k], [() for _ in strategies], k) for k in scalars if op.inputs[k] not in free],
            ops=[op.index],
            descriptions=list(descriptions),
            free_requires=[(op.inputs[k], in_specs[k]) for k in arrays if op.inputs[k] in free],
            comm_s=[s.comm_time for s in strategies],
            comm_times=[list(ts) for ts in comm_times],
            combined=list(groups),
            async_s=[s.comm_time if combined else 0.0 for s in strategies],
        )
        nodes.append(node)
        for t in op.outputs:
            owner[t] = node.index

    edges = []
    for node in nodes:
        for tid, req, k in node.requires:
            src = owner[tid]
            edges.append(Edge(src, node.index, tid, tuple(nodes[src].owned[tid]), tuple(req), node.ops[0], k))
    for tid, dst, req, op_index, k in extra_edges:
        src = owner[tid]
        edges.append(Edge(src, dst, tid, tuple(nodes[src].owned[tid]), tuple(req), op_index, k))

    ties = []
    donated: list[tuple[int, int]] = []
    pinned_outputs: dict[int, Spec] = {}
    if tie_outputs:
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

    ties.extend((a, b) for a, b in graph.loop_ties if a in owner and b in owner)
    for name, n in sorted(fallback.items()):
        log.warning("no sharding rule for primitive %r (%d ops): planned replicated", name, n)
    rep = tuple(range(len(nodes)))
    # time is the preset's, memory the devices' the program compiles for: their XLA fuses the update
    # (which values it never writes) by its own rules
    memory_platform = device_platform or cost.hardware.platform  # as `Problem.memory_platform`
    unwritten_by = memory_traffic if memory_platform == cost.hardware.platform else fusions(graph, memory_platform)
    if share_layers:
        rep = layer_representatives(nodes, graph)
        if len(set(rep)) == len(rep):  # no repeated layers by name: find them by structure
            rep = structural_representatives(nodes, graph, edges)
    unwritten = frozenset(t for op in graph.ops for t, w in zip(op.outputs, unwritten_by[op.index].writes) if not w)
    again = recomputed(graph, memory_platform)
    live = live_ranges(graph, donated, fused_away(graph, unwritten, combinable, memory_platform, again))
    return Problem(graph, cost, tuple(nodes), tuple(edges), owner, tuple(ties), live,
                   tuple(sorted(fallback)), frozenset(free), rep, frozenset(combinable),
                   pinned_outputs=pinned_outputs, donated=tuple(donated), unwritten=unwritten,
                   recomputed=again, device_platform=device_platform)


@dataclasses.dataclass(frozen=True, slots=True)
class _Followed:
    """What a follower op adds to its lead node, per strategy of the node (`follow`), computed once
    per distinct question and added to each node that asks it (repeated layers ask the same).

    Attributes:
      costs: seconds added to `Node.costs` (its own cost plus the collectives before it).
      comm_s: seconds added to `Node.comm_s`.
      async_s: seconds added to `Node.async_s` (combinable ops; else zeros).
      groups: (kind, axes) groups joined (`Node.combined`).
      comms: (strategy, its collectives, their seconds) for the strategies with collectives only.
      out_specs: the follower's result spec per strategy.
      needs: per other array operand position, the spec the op reads it in, per strategy.
    """

    costs: tuple[float, ...]
    comm_s: tuple[float, ...]
    async_s: tuple[float, ...]
    groups: tuple[frozenset, ...]
    comms: tuple[tuple[int, list[Comm], list[float]], ...]
    out_specs: tuple[Spec, ...]
    needs: dict[int, tuple[Spec, ...]]


def _followed(sig, lead: int, specs: Sequence[Spec], ins, outs, cost: CostModel, combined: bool, traffic,
              others: Sequence[int], answers: dict | None = None, key: tuple = ()) -> _Followed:
    """`_Followed` of one follower op for its lead node's `specs`. `answers` (with the question's
    `key` without the spec) caches the answer per lead spec: lead nodes of different strategy lists
    share most of their specs (gpt2-small on 2x2x2: 81,941 specs asked, 10,596 distinct)."""
    costs, comm_s, async_s, groups, comms, out_specs = [], [], [], [], [], []
    needs: dict[int, list[Spec]] = {k: [] for k in others}
    answers = {} if answers is None else answers
    for i, spec in enumerate(specs):
        found = answers.get((key, spec))
        if found is None:
            strat, pre = follow(sig, lead, spec, ins, outs, cost, combined, traffic)
            times = ([cost.collective_time(kd, b, a) for kd, a, b in pre]
                     + [cost.collective_time(kd, b, a, combined) for kd, a, b in strat.comms])
            pre_s = sum(times[: len(pre)])
            found = answers[(key, spec)] = (
                strat.cost + pre_s, strat.comm_time + pre_s, strat.comm_time if combined else 0.0,
                _groups(strat.comms) if combined else frozenset(),
                (list(pre) + list(strat.comms), times) if pre or strat.comms else None, strat.out_specs[0],
                tuple(strat.in_specs[k] if strat.in_specs[k] is not None else ((),) * len(ins[k].shape)
                      for k in others))
        cost_s, comm, hideable, group, collectives, out_spec, need = found
        costs.append(cost_s)
        comm_s.append(comm)
        async_s.append(hideable)
        groups.append(group)
        if collectives is not None:
            comms.append((i, list(collectives[0]), collectives[1]))
        out_specs.append(out_spec)
        for k, n in zip(others, need):
            needs[k].append(n)
    return _Followed(tuple(costs), tuple(comm_s), tuple(async_s), tuple(groups), tuple(comms), tuple(out_specs),
                     {k: tuple(v) for k, v in needs.items()})


def _sig_key(sig) -> tuple:
    """What of an op's signature its strategies depend on (`where` only names it in errors)."""
    return (sig.inputs, sig.outputs, tuple(sorted(sig.sizes.items())), sig.sum_labels, sig.flops, sig.known,
            sig.pinned)


def _groups(comms: Sequence[Comm]) -> frozenset[tuple[str, tuple[int, ...]]]:
    """The (kind, axes) groups of combinable collectives (XLA's combiners merge each group into one)."""
    return frozenset((kind, tuple(sorted(axes))) for kind, axes, _ in comms)


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


_PARTS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def layer_representatives(nodes: Sequence[Node], graph: Graph, min_repeats: int = 2) -> tuple[int, ...]:
    """Maps each node to the node of the first repeated layer that plays the same part.

    Repeated layers are module names like `blocks_0 ... blocks_11`: a name prefix seen with at
    least `min_repeats` indices whose modules contain further modules (`blocks_3/attn/query`), so
    that two leaf layers of an MLP (`dense_0`, `dense_1`), which may well want different
    shardings, are not mistaken for repeats. Nodes that play the same part in two layers (same
    label up to the layer index, same position among such nodes, same types and strategies) share
    one decision, as Meta's AutoParallel does: the ILP shrinks by the layer count and identical
    layers get identical shardings.
    """
    seen: dict[str, set[str]] = defaultdict(set)
    nested: set[str] = set()
    for node in nodes:
        for m in find_indexed(node.label):
            seen[m.group(1)].add(m.group(2))
            if len(_PARTS.findall(node.label[m.end():])) >= 2:
                nested.add(m.group(1))
    prefixes = {p for p, idx in seen.items() if len(idx) >= min_repeats and p in nested}
    if not prefixes:
        return tuple(range(len(nodes)))
    count: dict[tuple, int] = defaultdict(int)
    first: dict[tuple, int] = {}
    rep = list(range(len(nodes)))
    for node in nodes:
        layer = tuple(m.group(0) for m in find_indexed(node.label) if m.group(1) in prefixes)
        if not layer:
            continue
        norm = star_indices(node.label, prefixes)
        occurrence = count[(norm, layer)]
        count[(norm, layer)] += 1
        signature_ = (
            norm, occurrence, node.size, tuple(node.costs),
            tuple((graph.tensors[t], tuple(v)) for t, v in node.owned.items()),
            tuple((graph.tensors[t], tuple(r), k) for t, r, k in node.requires),
        )
        if signature_ in first:
            rep[node.index] = first[signature_]
        else:
            first[signature_] = node.index
    return tuple(rep)


# A repeated block found by structure holds at least this many matmuls. An attention or MLP block
# holds four or more forward (eight or more with its backward); one dense layer holds one forward and
# two backward, and a stack of identical dense layers may well want alternating shardings (Megatron's
# column / row pairs), which sharing single layers would forbid.
MIN_BLOCK_MATMULS = 3


def structural_representatives(nodes: Sequence[Node], graph: Graph, edges: Sequence[Edge]) -> tuple[int, ...]:
    """Layer sharing by structure, for programs whose repeated layers carry no indexed module names
    (plain JAX, lists of layer dicts, `jax.checkpoint`-wrapped blocks, any naming).

    1. Each node gets a structural signature: its ops' primitives, its strategies (costs, owned and
       required tensor types and specs, operand positions); names are not part of it.
    2. The op nodes in program order are a sequence of signatures; repeated layers are tandem
       repeats in it (the forward layers, the backward layers in reverse order). Per position the
       period whose run of copies covers the most nodes is found (all periods at once, vectorised),
       and runs are taken greedily from the start; a run's block must hold `MIN_BLOCK_MATMULS`
       matmuls. The k-th node of every copy shares the decision of the k-th node of the first,
       also in a last copy that matches only in part (the first layer's backward, which computes no
       gradient for the step's input).
    3. Sharing then spreads to the nodes next to shared ones (parameters, optimizer state, the
       optimizer update): nodes with equal signatures whose neighbours play the same parts (same
       representative, same operand position and tensor) share one decision, until nothing changes.
       A node with no shared neighbour spreads nothing.
    """
    ids: dict[tuple, int] = {}
    local: list[int] = []
    for node in nodes:
        key = (
            tuple(graph.ops[i].name for i in node.ops), node.size, tuple(node.costs), tuple(node.async_s),
            tuple((graph.tensors[t], tuple(v)) for t, v in node.owned.items()),
            tuple((graph.tensors[t], tuple(r), k) for t, r, k in node.requires),
        )
        local.append(ids.setdefault(key, len(ids)))
    rep = list(range(len(nodes)))
    order = [node.index for node in nodes[len(graph.inputs):]]  # op nodes, in program order
    seq = np.array([local[i] for i in order], dtype=np.int64)
    heavy = np.array([sum(graph.ops[o].name in HEAVY for o in nodes[i].ops) for i in order], dtype=np.int64)
    for start, period, length in tandem_runs(seq, heavy, MIN_BLOCK_MATMULS):
        for k in range(period, length):
            rep[order[start + k]] = order[start + k % period]
    if len(set(rep)) == len(rep):
        return tuple(rep)
    tensor_pos = [{t: k for k, t in enumerate(node.owned)} for node in nodes]
    op_pos = [{o: k for k, o in enumerate(node.ops)} for node in nodes]
    incident: list[list[tuple]] = [[] for _ in nodes]
    for e in edges:
        here = (tensor_pos[e.src][e.tensor], op_pos[e.dst].get(e.op, -1), e.pos)
        incident[e.dst].append((e.src, ("in",) + here))
        incident[e.src].append((e.dst, ("out",) + here))
    for _ in range(len(nodes)):
        size: dict[int, int] = defaultdict(int)
        for r in rep:
            size[r] += 1
        groups: dict[tuple, list[int]] = defaultdict(list)
        for node in nodes:
            i = node.index
            if size[rep[i]] > 1:
                continue
            around = []
            anchored = False
            for other, where in incident[i]:
                if size[rep[other]] > 1:
                    anchored = True
                    around.append((where, rep[other], -1))
                else:
                    around.append((where, -1, local[other]))
            if anchored:
                groups[(local[i], tuple(sorted(around)))].append(i)
        changed = False
        for members in groups.values():
            for m in members[1:]:
                rep[m] = members[0]
                changed = True
        if not changed:
            break
    return tuple(rep)


def tandem_runs(seq: np.ndarray, weight: np.ndarray | None = None, min_weight: int = 0) -> list[tuple[int, int, int]]:
    """(start, period, length) of runs in `seq`: `seq[start + k] == seq[start + k % period]` for k
    below `length`, at least two whole blocks of `period` items and the block weighing at least
    `min_weight`; disjoint, taken greedily from the start; at each position the period covering the
    most items wins (the shortest among equals)."""
    seq = np.asarray(seq, dtype=np.int64)
    n = len(seq)
    if weight is None:
        weight = np.zeros(n, dtype=np.int64)
    cover = np.zeros(n, dtype=np.int64)
    best = np.zeros(n, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(weight)])
    for p in range(1, n // 2 + 1):
        m = n - p
        same = seq[:m] == seq[p:]
        # length of the run of equal pairs starting at each position
        stop = np.where(same, m, np.arange(m))
        run = np.minimum.accumulate(stop[::-1])[::-1] - np.arange(m)
        c = np.where((run >= p) & (cum[p:p + m] - cum[:m] >= min_weight), run + p, 0)
        better = c > cover[:m]
        cover[:m][better] = c[better]
        best[:m][better] = p
    out = []
    i = 0
    while i < n:
        if cover[i]:
            out.append((i, int(best[i]), int(cover[i])))
            i += int(cover[i])
        else:
            i += 1
    return out


# Backends whose memory the model gives no value XLA keeps inside a fusion (`planner.graph.fusion`): on
# XLA:GPU such a value is never written (measured on an H100: the zoo's unsharded steps' compiled
# peaks were over-predicted 1.46-2.13x while they counted, 1.02-1.13x without; experiments/check_gpu.py).
# XLA:CPU keeps the optimizer update's only: dropping them all there under-predicted wresnet-tiny (0.68x).
KEEPS_FUSED_VALUES_IN_REGISTERS = frozenset({"gpu"})


def kept_in_fusion(tid: int, producer: int, unwritten: Collection[int], combinable: Collection[int],
                   platform: str, recomputed: Collection[int] = ()) -> bool:
    """Whether the memory model gives value `tid` (made by op `producer`) no buffer: XLA computes it
    inside the fusion reading it and never writes it (`unwritten`); on `platform`s outside
    `KEEPS_FUSED_VALUES_IN_REGISTERS`, only a value of the optimizer update (the combinable tail) and
    one XLA recomputes in the fusions that read it (`recomputed`, `planner.graph.fusion.recomputed`)."""
    if tid in recomputed:
        return True
    return tid in unwritten and (platform in KEEPS_FUSED_VALUES_IN_REGISTERS or producer in combinable)


def fused_away(graph: Graph, unwritten: Collection[int], combinable: Collection[int],
               platform: str = "cpu", recomputed: Collection[int] = ()) -> frozenset[int]:
    """Values the memory model gives no buffer (`kept_in_fusion`; `ilp.solver._materialised`)."""
    return frozenset(t for op in graph.ops for t in op.outputs
                     if kept_in_fusion(t, op.index, unwritten, combinable, platform, recomputed))


def last_reads(graph: Graph, fused: Collection[int] = ()) -> list[int]:
    """Per tensor, the last op that reads it (-1: none), where a read of a `fused` value is a read
    of that value's operands: XLA recomputes the value inside each fusion that consumes it, so its
    operands stay in memory until then (a bf16 gradient converted to float32 for the update is read
    by the update, not by the convert right after the backward)."""
    last = [-1] * len(graph.tensors)
    for op in graph.ops:
        for x in op.inputs:
            if isinstance(x, int):
                last[x] = max(last[x], op.index)
    for op in reversed(graph.ops):  # a fused value's readers come later: its last read is final here
        reach = max((last[t] for t in op.outputs if t in fused), default=-1)
        if reach > op.index:
            for x in op.inputs:
                if isinstance(x, int):
                    last[x] = max(last[x], reach)
    return last


def live_ranges(graph: Graph, donated: Sequence[tuple[int, int]] = (),
                fused: Collection[int] = ()) -> tuple[tuple[int, int], ...]:
    """(first, last) op index during which each tensor occupies memory.

    Arguments and constants live for the whole program, except a donated argument (`donated`:
    (argument, the output that takes its buffer) pairs, `build_problem`), which lives to its last
    use, or to just before it when that use writes the output (an in-place update: one buffer, as
    XLA aliases it); one that is never read lives nowhere. Results live from
    their producer to their last use, or to the end when they are program outputs. A result that
    never leaves its fusion (`planner.graph.fusion`) still counts from its producer to its last use: XLA
    keeps it in registers, but dropping such values under-predicted XLA:CPU's compiled peak of the
    conv net with batch norm (wresnet-tiny, 0.68x; experiments/check_memory.py). The `fused` values
    of the optimizer update (`fused_away`) take no memory; their operands are read where they are
    (`last_reads`).
    """
    end = len(graph.ops)
    first = [-1] * len(graph.tensors)
    last = last_reads(graph, fused)
    for op in graph.ops:
        for t in op.outputs:
            first[t] = op.index
            last[t] = max(op.index, last[t])
    used = {tin: last[tin] for tin, _ in donated}
    for t in list(graph.inputs) + list(graph.consts):
        first[t], last[t] = -1, end
    for x in graph.outputs:
        if isinstance(x, int):
            last[x] = end
    for tin, tout in donated:
        last[tin] = used[tin] - 1 if used[tin] == first[tout] else used[tin]
    return tuple(zip(first, last))


def offloaded_live_ranges(graph: Graph, live: Sequence[tuple[int, int]], offloaded: Sequence[tuple[int, int]],
                          fused: Collection[int] = (), copied: bool = True,
                          update: Collection[int] | None = None) -> tuple[tuple[int, int], ...]:
    """`live` with the device ranges of host-offloaded values (`planner.ilp.offload`).

    `copied` (XLA:GPU, TPU): the update runs on device copies: an argument kept on the host is on
    the device from its first consumer in `update` (the optimizer update's ops; None: any op) to its
    last read (it is copied in for the optimizer update; reads before it, a master parameter's
    casts, copy it for themselves: `Problem.host_reads`), and its new value from its producer to
    its last read inside the step (then it is copied out); neither is held to the end of the step.
    Reads as `last_reads`. Not `copied` (XLA:CPU): the update's fusions read and write the host
    buffers in place, so neither is ever on the device (the
    compiled HLO has memory space S(5) only in its entry layout and no copies, and its temporary
    bytes do not change when leaves move to the host; tests/test_offload.py)."""
    first_use = [-1] * len(graph.tensors)
    for op in reversed(graph.ops):
        if update is not None and op.index not in update:
            continue
        for x in op.inputs:
            if isinstance(x, int):
                first_use[x] = op.index
    last = last_reads(graph, fused)
    out = list(live)
    nowhere = (-1, -2)
    for tin, tout in offloaded:
        if not copied:
            out[tin] = nowhere
            if tout >= 0:
                out[tout] = nowhere
            continue
        if first_use[tin] >= 0:
            out[tin] = (first_use[tin], last[tin])
        if tout >= 0:
            first = live[tout][0]
            out[tout] = (first, max(last[tout], first))
    return tuple(out)
