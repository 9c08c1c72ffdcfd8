"""Layer sharing: repeated layers share one decision, found by their indexed module names or by
structure (tandem repeats of the nodes' signatures)."""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from planner.core.layer_index import find_indexed, star_indices
from planner.graph.ir import Graph
from planner.ilp.followers import HEAVY
from planner.ilp.nodes import Edge, Node

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
