"""Layer clustering: which layer each op of a traced program belongs to.

Pipeline stages are ranges of consecutive layers, so the inter-op planner first needs layers.
Two sources, tried in this order:

* the model's own structure: ops created inside repeated modules (`blocks_0 ... blocks_N` in the
  op's name stack) belong to that module's layer; parameters and optimizer state whose pytree path
  names the module belong to it too;
* otherwise Alpa's clustering objective: the forward ops, in program order, are cut into `L`
  consecutive layers whose FLOPs stay within `(1 + delta)` of the average, with the smallest total
  bytes crossing the cuts (a dynamic program over cut positions).

Ops no rule labels (embedding lookups before the first block, the head and the loss after the last,
backward ops without a module path, optimizer updates) take the layer of the data they touch:
forward and optimizer ops the latest layer among their producers, backward ops the earliest
(a backward op combines this layer's residuals with the next layer's cotangent), and ops still
unlabelled after that the earliest layer among their consumers.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np

from planner.core.errors import InvalidArgumentError
from planner.graph.ir import Graph, Literal
from planner.ilp.rules import signature
from planner.core.layer_index import COND_BRANCH, SCAN_ITERATION, find_indexed, star_indices

FORWARD, BACKWARD, APPLY = "forward", "backward", "apply"


@dataclasses.dataclass(frozen=True, slots=True)
class Layers:
    """Ops of one graph grouped into consecutive layers.

    Attributes:
      op_layer: layer of each op, in `graph.ops` order.
      input_layer: layer of each graph input (the layer of its first consumer when it names none).
      op_phase: per op, "forward", "backward" (inside the gradient) or "apply" (the update after it).
      names: a readable name per layer ("blocks_3", or "ops 120-245").
      keys: per layer a fingerprint of its ops and shapes; equal keys mean identical layers, whose
        costs are computed once and reused.
      method: "modules" (the model's own repeated modules) or "flops" (balanced clustering).
    """

    op_layer: tuple[int, ...]
    input_layer: tuple[int, ...]
    op_phase: tuple[str, ...]
    names: tuple[str, ...]
    keys: tuple[str, ...]
    method: str

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def ops_of(self, layer: int, phases: Sequence[str] = (FORWARD, BACKWARD, APPLY)) -> tuple[int, ...]:
        return tuple(i for i, (l, p) in enumerate(zip(self.op_layer, self.op_phase)) if l == layer and p in phases)


def op_phases(graph: Graph) -> tuple[str, ...]:
    """Forward / backward / apply phase of each op, from the name stacks `jax.grad` leaves.

    Under `jax.value_and_grad` the forward ops carry a `jvp(...)` name stack and the backward ops a
    `transpose(...)` one; ops after the last backward op that carry neither are the update. A graph
    with no backward op (a forward-only program) is all forward.
    """
    stacks = [op.name_stack for op in graph.ops]
    last_bwd = max((i for i, s in enumerate(stacks) if s.startswith("transpose(")), default=-1)
    out = []
    for i, s in enumerate(stacks):
        if s.startswith("transpose("):
            out.append(BACKWARD)
        elif last_bwd >= 0 and i > last_bwd and not s.startswith("jvp("):
            out.append(APPLY)
        else:
            out.append(FORWARD)
    return tuple(out)


def repeated_module(graph: Graph, min_repeats: int = 2) -> str | None:
    """The module name prefix of the model's repeated layers (`blocks` for `blocks_0..N`).

    Candidates are names indexed at least `min_repeats` ways. A family that only ever appears inside
    another's scope (`Dense_0, Dense_1` inside every `blocks_i`, a loop's iterations inside a
    layer) is part of those layers, not a layer family of its own; a loop's unrolled iterations
    (`SCAN_ITERATION`, named by the tracer) are layers only where the model names none itself
    (scanned layers), so a loop between two of the model's layers belongs to the layer that feeds
    it; a cond's branches (`COND_BRANCH`) are alternatives, never layers. Among what is left, the
    family with the most ops."""
    indices: dict[str, set[str]] = defaultdict(set)
    ops: Counter = Counter()
    outer: dict[str, set[str]] = {}  # family -> families found before it in every stack bearing it
    for op in graph.ops:
        seen: list[str] = []
        for m in find_indexed(op.name_stack):
            name = m.group(1)
            indices[name].add(m.group(2))
            if name not in seen:
                outer[name] = outer[name] & set(seen) if name in outer else set(seen)
                seen.append(name)
        ops.update(seen)
    candidates = {p for p, idx in indices.items() if len(idx) >= min_repeats and p != COND_BRANCH}
    candidates = [p for p in candidates if not (outer.get(p, set()) - {p}) & candidates]
    named = [p for p in candidates if p != SCAN_ITERATION]
    candidates = named or candidates
    if not candidates:
        return None
    return max(candidates, key=lambda p: (ops[p], p))


def _module_index(text: str, prefix: str) -> int | None:
    for m in find_indexed(text):
        if m.group(1) == prefix:
            return int(m.group(2))
    return None


def _match_backward(graph: Graph, op_layer: list[int | None], phases: Sequence[str]) -> None:
    """Backward ops take the layer of the forward ops with the same module path (in place):
    `transpose(jvp(GPT))/ln_f` is the backward of `jvp(GPT)/ln_f`."""
    by_stack: dict[str, int] = {}
    for op in graph.ops:
        s = op.name_stack
        if phases[op.index] == FORWARD and s.startswith("jvp(") and op_layer[op.index] is not None:
            rest = s[s.find(")") + 1:]
            if rest:
                by_stack.setdefault(rest, op_layer[op.index])
    for op in graph.ops:
        s = op.name_stack
        if phases[op.index] == BACKWARD and op_layer[op.index] is None and s.startswith("transpose(jvp("):
            rest = s[s.find("))") + 2:]
            if rest in by_stack:
                op_layer[op.index] = by_stack[rest]


def _propagate(graph: Graph, op_layer: list[int | None], input_layer: list[int | None],
               phases: Sequence[str]) -> None:
    """Fills unlabelled ops and inputs (in place).

    Order: backward ops by module path; inputs from the forward ops that read them (the earliest
    layer); forward and update ops from their producers (the latest layer); backward ops from the
    parameters and forward values they read (the latest); then, walking backwards, remaining
    backward ops from their consumers (the latest: the gradient flows towards earlier layers, so a
    cotangent-only op between two layers' backward belongs to the later one's side) and other ops
    from their consumers (the earliest); then what is left from its producers (the earliest).
    """
    _match_backward(graph, op_layer, phases)
    first_fwd_use: dict[int, int] = {}
    for op in graph.ops:
        if phases[op.index] == FORWARD and op_layer[op.index] is not None:
            for t in op.tensor_inputs:
                first_fwd_use[t] = min(first_fwd_use.get(t, op_layer[op.index]), op_layer[op.index])
    for k, t in enumerate(graph.inputs):
        if input_layer[k] is None and t in first_fwd_use:
            input_layer[k] = first_fwd_use[t]
    tensor_layer: dict[int, int] = {t: l for t, l in zip(graph.inputs, input_layer) if l is not None}
    forward_made: set[int] = set(tensor_layer)
    for op in graph.ops:
        if op_layer[op.index] is None:
            if phases[op.index] != BACKWARD:
                known = [tensor_layer[t] for t in op.tensor_inputs if t in tensor_layer]
            else:
                known = [tensor_layer[t] for t in op.tensor_inputs if t in forward_made and t in tensor_layer]
            if known:
                op_layer[op.index] = max(known)
        if op_layer[op.index] is not None:
            for t in op.outputs:
                tensor_layer[t] = op_layer[op.index]
                if phases[op.index] == FORWARD:
                    forward_made.add(t)
    uses: dict[int, list[int]] = defaultdict(list)
    for op in reversed(graph.ops):
        if op_layer[op.index] is None:
            cons = [l for t in op.outputs for l in uses.get(t, ())]
            if cons:
                op_layer[op.index] = max(cons) if phases[op.index] == BACKWARD else min(cons)
        if op_layer[op.index] is not None:
            for t in op.tensor_inputs:
                uses[t].append(op_layer[op.index])
    for op in graph.ops:
        if op_layer[op.index] is None:
            known = [tensor_layer[t] for t in op.tensor_inputs if t in tensor_layer]
            op_layer[op.index] = min(known) if known else 0
        for t in op.outputs:
            tensor_layer.setdefault(t, op_layer[op.index])
    for k, t in enumerate(graph.inputs):
        if input_layer[k] is None:
            input_layer[k] = min(uses.get(t, [0]))


def _layer_keys(graph: Graph, op_layer: Sequence[int], num_layers: int, prefix: str | None) -> tuple[str, ...]:
    """Fingerprint of each layer: primitives, params, shapes and module paths with the layer index masked.

    Operands are written relative to the layer (position of the producing op inside the layer,
    or the type of a value coming from outside), so identical layers get identical keys.
    """
    members: list[list[int]] = [[] for _ in range(num_layers)]
    for i, l in enumerate(op_layer):
        members[l].append(i)
    producers = graph.producers()
    # Written once per distinct tensor type and literal value (the repr of numpy values and
    # dtypes is slow, and repeated layers repeat the same ones).
    types: dict = {}
    literals: dict = {}

    def type_of(t) -> str:
        text = types.get(t)
        if text is None:
            text = types[t] = f"{t.shape}{t.dtype}"
        return text

    def literal(x: Literal) -> str:
        v = np.asarray(x.value)
        raw = (v.dtype.str, v.shape, v.tobytes()) if v.dtype != object else repr(x.value)
        text = literals.get(raw)
        if text is None:
            text = literals[raw] = f"lit{raw}{type_of(x.tensor)}"
        return text

    keys = []
    for l in range(num_layers):
        h = hashlib.sha1()
        local = {i: k for k, i in enumerate(members[l])}
        for i in members[l]:
            op = graph.ops[i]
            stack = op.name_stack
            if prefix is not None:
                stack = star_indices(stack, (prefix,))
            operands = []
            for x in op.inputs:
                if isinstance(x, Literal):
                    operands.append(literal(x))
                    continue
                src = producers.get(x)
                where = ("op", local[src[0]], src[1]) if src is not None and src[0] in local else ("ext",)
                operands.append((where, type_of(graph.tensors[x])))
            params = sorted((k, repr(v)) for k, v in op.params.items()
                            if not hasattr(v, "jaxpr") and not hasattr(v, "eqns"))
            h.update(repr((op.name, stack, params, operands,
                           [type_of(graph.tensors[t]) for t in op.outputs])).encode())
        keys.append(h.hexdigest()[:16])
    return tuple(keys)


def cluster_by_modules(graph: Graph, prefix: str | None = None) -> Layers | None:
    """Layers from the model's repeated modules (`prefix_0 ... prefix_N`), or None when there are none.

    Forward ops outside the modules before the first one (embeddings) form a layer "pre", those
    after the last one (final norm, head, loss) a layer "post", so that the repeated layers stay
    identical and are costed once.
    """
    prefix = prefix or repeated_module(graph)
    if prefix is None:
        return None
    phases = op_phases(graph)
    raw = [_module_index(op.name_stack, prefix) for op in graph.ops]
    raw_in = [_module_index(p, prefix) for p in graph.input_paths]
    order = sorted({i for i in raw + raw_in if i is not None})
    if len(order) < 2:
        return None
    fwd_in_module = [op.index for op in graph.ops if phases[op.index] == FORWARD and raw[op.index] is not None]
    first, last = fwd_in_module[0], fwd_in_module[-1]
    fwd_free = [op.index for op in graph.ops if phases[op.index] == FORWARD and raw[op.index] is None]
    real = [i for i in fwd_free if graph.ops[i].tensor_inputs]
    has_pre = any(i < first for i in real)
    has_post = any(i > last for i in real)
    base = 1 if has_pre else 0
    rank = {idx: base + k for k, idx in enumerate(order)}
    post = base + len(order)
    op_layer: list[int | None] = [None if i is None else rank[i] for i in raw]
    for i in fwd_free:
        if has_pre and i < first:
            op_layer[i] = 0
        elif has_post and i > last:
            op_layer[i] = post
    input_layer: list[int | None] = [None if i is None else rank[i] for i in raw_in]
    _propagate(graph, op_layer, input_layer, phases)
    names = (("pre",) if has_pre else ()) + tuple(f"{prefix}_{i}" for i in order) + (("post",) if has_post else ())
    return Layers(tuple(op_layer), tuple(input_layer), phases, names,
                  _layer_keys(graph, op_layer, len(names), prefix), "modules")


def cut_bytes(graph: Graph, ops: Sequence[int]) -> np.ndarray:
    """`out[p]`: bytes of values made by `ops[:p]` and used by `ops[p:]` (program inputs excluded)."""
    delta = np.zeros(len(ops) + 2, dtype=np.float64)
    last: dict[int, int] = {}
    for k, i in enumerate(ops):
        for t in graph.ops[i].tensor_inputs:
            last[t] = k
    for k, i in enumerate(ops):
        for t in graph.ops[i].outputs:
            end = last.get(t)
            if end is not None and end > k:
                delta[k + 1] += graph.tensors[t].nbytes
                delta[end + 1] -= graph.tensors[t].nbytes
    return np.cumsum(delta)[: len(ops) + 1]


def balanced_cuts(flops: Sequence[float], cuts: Sequence[float], num_layers: int, delta: float = 0.1) -> list[int]:
    """Alpa's clustering: cut a sequence into `num_layers` non-empty pieces, each with at most
    `(1 + delta)` times the average FLOPs, minimising the summed cost of the cut positions.

    Args:
      flops: FLOPs of each element, in order.
      cuts: `cuts[p]` is the cost of cutting before element p (length len(flops) + 1).
      num_layers: pieces wanted.
      delta: allowed imbalance; doubled until a solution exists.

    Returns:
      The start position of each piece (the first is 0).
    """
    n = len(flops)
    if not 1 <= num_layers <= n:
        raise InvalidArgumentError(f"cannot cut {n} ops into {num_layers} layers; choose 1 <= layers <= {n}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(flops, dtype=np.float64))])
    total = prefix[-1]
    cost = np.asarray(cuts, dtype=np.float64)
    while True:
        cap = (1.0 + delta) * total / num_layers + 1e-9 * max(total, 1.0)
        # best[l][p]: least cut cost of l pieces covering elements [0, p); arg for reconstruction.
        best = np.full((num_layers + 1, n + 1), np.inf)
        arg = np.zeros((num_layers + 1, n + 1), dtype=np.int64)
        best[0][0] = 0.0
        lo = np.searchsorted(prefix, prefix - cap, side="left")  # first q with flops(q..p) <= cap
        for l in range(1, num_layers + 1):
            prev = best[l - 1]
            for p in range(l, n + 1):
                q0 = max(int(lo[p]), l - 1)
                if q0 > p - 1:
                    continue
                window = prev[q0:p]
                j = int(np.argmin(window))
                if np.isfinite(window[j]):
                    best[l][p] = window[j] + (cost[p] if p < n else 0.0)
                    arg[l][p] = q0 + j
        if np.isfinite(best[num_layers][n]) or delta > 64:
            break
        delta *= 2
    starts = []
    p = n
    for l in range(num_layers, 0, -1):
        q = int(arg[l][p])
        starts.append(q)
        p = q
    return starts[::-1]


def cluster_by_flops(graph: Graph, num_layers: int, delta: float = 0.1) -> Layers:
    """Layers by Alpa's objective over the forward ops; the rest follow their data (see module doc)."""
    phases = op_phases(graph)
    fwd = [op.index for op in graph.ops if phases[op.index] == FORWARD]
    num_layers = max(1, min(num_layers, len(fwd)))
    flops = [signature(graph.ops[i], graph).flops for i in fwd]
    starts = balanced_cuts(flops, cut_bytes(graph, fwd), num_layers, delta)
    op_layer: list[int | None] = [None] * len(graph.ops)
    bounds = list(starts) + [len(fwd)]
    names = []
    for l in range(num_layers):
        for k in range(bounds[l], bounds[l + 1]):
            op_layer[fwd[k]] = l
        names.append(f"ops {fwd[bounds[l]]}-{fwd[bounds[l + 1] - 1]}")
    input_layer: list[int | None] = [None] * len(graph.inputs)
    _propagate(graph, op_layer, input_layer, phases)
    return Layers(tuple(op_layer), tuple(input_layer), phases, tuple(names),
                  _layer_keys(graph, op_layer, num_layers, None), "flops")


def cluster_layers(graph: Graph, num_layers: int | None = None, delta: float = 0.1) -> Layers:
    """The graph's layers: the model's repeated modules when it has them, else balanced clustering.

    Args:
      graph: the traced program (a train step or a forward function).
      num_layers: wanted layer count for balanced clustering (default 8); ignored when the model's
        own modules define the layers.
      delta: FLOPs imbalance allowed by the balanced clustering.
    """
    layers = cluster_by_modules(graph)
    if layers is not None:
        return layers
    return cluster_by_flops(graph, num_layers or 8, delta)



def stacked_inputs(graph: Graph, layers: Layers) -> tuple[int, ...]:
    """Positions in `graph.inputs` of leaves stacked over layers: sliced (a scan's per-iteration
    index, `slice` then `squeeze`) into values that ops of two or more layers read, as a scanned
    model's weights (`nn.scan`, MaxText's scan_layers) are. A pipeline stage owns whole leaves
    (`partition.partition`), so such a leaf cannot follow its layers to their stages."""
    readers: dict[int, list[int]] = {}
    for op in graph.ops:
        for t in op.tensor_inputs:
            readers.setdefault(t, []).append(op.index)
    out = []
    for pos, t in enumerate(graph.inputs):
        reached: set[int] = set()
        for s in readers.get(t, ()):
            if graph.ops[s].name != "slice":
                continue
            frontier = list(graph.ops[s].outputs)
            while frontier:  # through the squeeze / reshape / convert that follow the slice
                for r in readers.get(frontier.pop(), ()):
                    op = graph.ops[r]
                    if op.name in ("squeeze", "reshape", "convert_element_type"):
                        frontier.extend(op.outputs)
                    else:
                        reached.add(layers.op_layer[r])
        if len(reached) >= 2:
            out.append(pos)
    return tuple(out)


def stacked_note(paths: Sequence[str]) -> str:
    """What pipelining a model whose weights are stacked over layers (a scan) means today."""
    return (f"{len(paths)} parameter leaves are stacked over layers by a scan (e.g. {paths[0]}): a stage owns "
            "whole leaves, so the first stage reading one holds all its layers' weights and optimizer state and "
            "sends each layer's slice on; to pipeline this model, unroll its layers (a Python loop; the zoo's "
            "scan_layers=False)")
