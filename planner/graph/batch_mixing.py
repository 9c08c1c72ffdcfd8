"""Which ops of a loss mix the examples of its batch: where splitting the batch changes the result.

A pipeline (and gradient accumulation) runs the loss on microbatches and averages: that is the
step's own result exactly when every op computes each example from that example alone, except
the loss's final mean or sum over the batch. A statistic over the batch (BatchNorm's mean, a
predicate over the whole batch, a token-weighted mean whose weight sums over examples, a loop
whose trip count reads several examples) is computed per microbatch instead.

The analysis follows the batch dimension (dimension 0 of every batch leaf) through the graph, one
rule per primitive (as the sharding rules are), and reports each op that combines the values of
several examples, except the reductions that make the loss from per-example terms (reached from
the loss through sums, means and scaling by values that hold no example).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence

from planner.core.compat import pallas_grid
from planner.graph.ir import Graph, Literal, Op
from planner.graph.kernels import parallel_axes, sharding_rule_factors

_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "reduce_xor", "argmax", "argmin"})
_SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Ops through which the loss is a sum of per-example terms scaled by example-free values.
_LINEAR = frozenset({"reduce_sum", "add", "sub", "neg", "mul", "div", "convert_element_type", "reshape",
                     "squeeze", "copy", "copy_p", "sharding_constraint"})


@dataclasses.dataclass(frozen=True, slots=True)
class Mixing:
    """One op that combines several examples' values.

    Attributes:
      op: its index in the graph.
      primitive: its primitive's name.
      name_stack: the module path it was traced in.
      reason: what it does to the batch dimension, in a few words.
    """

    op: int
    primitive: str
    name_stack: str
    reason: str

    def describe(self) -> str:
        where = f" in {self.name_stack}" if self.name_stack else ""
        return f"{self.primitive}{where} {self.reason}"


def summary(found: Sequence[Mixing]) -> str:
    """The first mixing op, and how many more: one line for a warning."""
    more = f" (and {len(found) - 1} more ops)" if len(found) > 1 else ""
    return found[0].describe() + more


def _shape(graph: Graph, x) -> tuple[int, ...]:
    return tuple(x.tensor.shape if isinstance(x, Literal) else graph.tensors[x].shape)


def _reshaped(old: tuple[int, ...], new: tuple[int, ...], b: int) -> int | None:
    """Where dimension `b` of `old` lands in `new`: the dimension with as many elements before it,
    which merges it with, or splits it from, the dimensions after it (examples stay contiguous)."""
    before = math.prod(old[:b])
    for k in range(len(new)):
        if math.prod(new[:k]) == before and new[k] and (new[k] % old[b] == 0 or old[b] % new[k] == 0):
            return k
    return None


# A batch rule: (graph, op, the operands' batch dimensions, output shapes, the first batched
# dimension) -> (batch dimension of each output, or None; why the op mixes examples, or None).
_Rule = Callable[..., tuple[list, "str | None"]]


def _rule(graph: Graph, op: Op, dims: Sequence[int | None]) -> tuple[list[int | None], str | None]:
    """(batch dimension of each output, or None; why the op mixes examples, or None)."""
    outs = [graph.tensors[t].shape for t in op.outputs]
    b = next((d for d in dims if d is not None), None)
    rule = _RULES.get(op.name)
    if rule is None:
        rule = _reduction if op.name in _REDUCTIONS else _scan if op.name in _SCANS else _elementwise
    return rule(graph, op, dims, outs, b)


def _broadcast(graph, op, dims, outs, b):
    return ([op.params["broadcast_dimensions"][dims[0]]] if dims[0] is not None else [None]), None


def _transpose(graph, op, dims, outs, b):
    return [list(op.params["permutation"]).index(dims[0])], None


def _reshape(graph, op, dims, outs, b):
    k = _reshaped(_shape(graph, op.inputs[0]), outs[0], dims[0])
    return ([k], None) if k is not None else ([None], "moves the batch dimension")


def _squeeze(graph, op, dims, outs, b):
    gone = set(op.params["dimensions"])
    return [dims[0] - sum(1 for d in gone if d < dims[0])], None


def _expand_dims(graph, op, dims, outs, b):
    return [dims[0] + sum(1 for d in op.params["dimensions"] if d <= dims[0])], None


def _reduction(graph, op, dims, outs, b):
    axes = tuple(op.params["axes"])
    if dims[0] in axes:
        return [None] * len(outs), "reduces over the batch dimension"
    return [dims[0] - sum(1 for a in axes if a < dims[0])] * len(outs), None


def _scan(graph, op, dims, outs, b):
    p = op.params
    axis = p.get("axis", p.get("dimension", len(_shape(graph, op.inputs[0])) - 1))
    if axis == dims[0] or (op.name == "sort" and any(d is not None and d == axis for d in dims)):
        return [None] * len(outs), "runs along the batch dimension"
    return [b] * len(outs), None


def _dot(graph, op, dims, outs, b):
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = _shape(graph, op.inputs[0]), _shape(graph, op.inputs[1])
    out = None
    for side, d, contract, batch, rank in ((0, dims[0], lc, lb, len(lhs)), (1, dims[1], rc, rb, len(rhs))):
        if d is None:
            continue
        if d in contract:
            return [None], "contracts over the batch dimension"
        if d in batch:
            k = list(batch).index(d)
        else:
            free = [i for i in range(rank) if i not in contract and i not in batch]
            k = len(lb) + free.index(d) + (0 if side == 0 else len(lhs) - len(lc) - len(lb))
        if out is not None and out != k:
            return [None], "pairs examples of its two operands"
        out = k
    return [out], None


def _slice_like(graph, op, dims, outs, b):
    name, p = op.name, op.params
    full = _shape(graph, op.inputs[0])[dims[0]]
    if outs[0][dims[0]] != full or (name == "slice" and (p.get("strides") or [1] * len(outs[0]))[dims[0]] != 1) \
            or (name == "pad" and any(p["padding_config"][dims[0]])) or (name == "rev" and dims[0] in p["dimensions"]):
        return [None], "selects, reorders or adds examples"
    return [dims[0]], None


def _dynamic_update_slice(graph, op, dims, outs, b):  # (operand, update, *start indices: scalars, never batched)
    d, u = dims[0], dims[1]
    if d is not None and (u == d or u is None) and _shape(graph, op.inputs[1])[d] == outs[0][d]:
        return [d], None  # whole rows: each example's own values, or the same for every example
    return [None], "writes examples into another array"


def _concatenate(graph, op, dims, outs, b):
    if op.params["dimension"] == b and any(d is None for d in dims):
        return [None], "adds rows to the batch dimension"
    return [b], None


def _stack(graph, op, dims, outs, b):
    """`stack` (a new axis at `axis`, as scans stack their per-iteration results)."""
    if any(d != b for d in dims):
        return [None], "stacks examples with values of another dimension"
    return [b + (op.params["axis"] <= b)], None


def _gather(graph, op, dims, outs, b):
    dn = op.params["dimension_numbers"]
    idx_rank = len(_shape(graph, op.inputs[1]))
    index_batch = [i for i in range(idx_rank) if i != idx_rank - 1]
    out_batch = [i for i in range(len(outs[0])) if i not in dn.offset_dims]
    if dims[0] is None and dims[1] is not None and dims[1] in index_batch:  # an unbatched table, batched indices
        return [out_batch[index_batch.index(dims[1])]], None
    if dims[0] is not None and dims[0] in getattr(dn, "operand_batching_dims", ()):
        idx_dim = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(dims[0])]
        return [out_batch[index_batch.index(idx_dim)]], None
    if dims[0] is not None and dims[0] not in dn.start_index_map and dims[0] not in dn.collapsed_slice_dims:
        slice_sizes = op.params["slice_sizes"]
        if slice_sizes[dims[0]] == _shape(graph, op.inputs[0])[dims[0]] and dims[1] is None:
            offset = [i for i in range(len(slice_sizes)) if i not in dn.collapsed_slice_dims
                      and i not in getattr(dn, "operand_batching_dims", ())]
            return [list(dn.offset_dims)[offset.index(dims[0])]], None
    return [None], "reads another example's values (gather)"


def _passthrough(graph, op, dims, outs, b):
    return [b] * len(outs), None


def _elementwise(graph, op, dims, outs, b):
    """Elementwise (and anything shaped like it): operands' batch dimensions must agree."""
    batched = [(d, _shape(graph, x)) for d, x in zip(dims, op.inputs) if d is not None]
    if len({d for d, _ in batched}) > 1:
        return [None] * len(outs), "pairs different dimensions of its operands with the batch"
    d, shape = batched[0]
    if all(len(o) == len(shape) and o[d] == shape[d] for o in outs):
        return [d] * len(outs), None
    return [None] * len(outs), f"has no batch rule ({op.name}); taken to mix examples"


def _pallas(graph, op, dims, outs, b):
    """A Pallas kernel: the batch must lie along a grid axis the kernel is independent along
    (`graph.kernels.parallel_axes`), which then indexes each result's batch dimension."""
    facts = pallas_grid(op.params)
    if facts is None:
        return [None] * len(outs), "runs a kernel it cannot read across the batch"
    axes = set(parallel_axes(facts)[0])
    n_in = len(facts.blocks) - facts.num_outputs
    lead = len(op.inputs) - n_in  # scalar-prefetch operands and run-time grid sizes come first
    found = {facts.blocks[k - lead][1][d] if k >= lead else None for k, d in enumerate(dims) if d is not None}
    if len(found) != 1 or not found <= axes:
        return [None] * len(outs), f"runs kernel {facts.name!r} across the batch"
    a = found.pop()
    return [facts.blocks[n_in + j][1].index(a) for j in range(len(outs))], None


def _declared(graph, op, dims, outs, b):
    """A kernel declared with `planner.register_kernel` (`custom_partitioning`): the batch along a
    declared name every result holds."""
    found = sharding_rule_factors(op, graph)
    if isinstance(found, str):
        return [None] * len(outs), f"runs a kernel whose rule it cannot read across the batch ({found})"
    operands, results, whole = found
    names = {operands[k][d] for k, d in enumerate(dims) if d is not None}
    shared = set.intersection(*(set(m) for m in results)) if results else set()
    if len(names) != 1 or None in names or not names <= shared - set(whole):
        return [None] * len(outs), "runs a declared kernel across the batch"
    name = names.pop()
    return [list(m).index(name) for m in results], None


_RULES: dict[str, _Rule] = {
    "broadcast_in_dim": _broadcast, "transpose": _transpose, "reshape": _reshape, "squeeze": _squeeze,
    "expand_dims": _expand_dims, "sort": _scan, "top_k": _scan, "dot_general": _dot,
    "slice": _slice_like, "dynamic_slice": _slice_like, "pad": _slice_like, "rev": _slice_like,
    "dynamic_update_slice": _dynamic_update_slice, "concatenate": _concatenate, "gather": _gather, "stack": _stack,
    "pallas_call": _pallas, "custom_partitioning": _declared,
    **{name: _passthrough for name in ("iota", "rng_bit_generator", "random_bits", "random_seed", "random_wrap",
                                       "random_unwrap")},
}


def mixing_ops(graph: Graph, batch_inputs: Sequence[int], loss: int | None = None,
               ops: Collection[int] | None = None) -> tuple[Mixing, ...]:
    """The ops of `graph` that combine several examples' values.

    Args:
      graph: a traced loss (or step) whose `batch_inputs` (tensor ids) hold examples along dim 0.
      loss: the scalar output made by summing or averaging per-example terms; the reductions that
        do that are not reported.
      ops: the ops to follow (default: all): a train step's forward ops, whose backward sums the
        examples' gradients by design.

    Returns:
      One `Mixing` per op, in program order (empty: the graph is microbatch-invariant).
    """
    dim: dict[int, int] = {t: 0 for t in batch_inputs if graph.tensors[t].shape}
    found: dict[int, Mixing] = {}
    producers = {t: op for op in graph.ops for t in op.outputs}
    wanted = None if ops is None else set(ops)
    for op in graph.ops:
        if wanted is not None and op.index not in wanted:
            continue
        dims = [dim.get(x) if isinstance(x, int) else None for x in op.inputs]
        if all(d is None for d in dims):
            continue
        out, why = _rule(graph, op, dims)
        if why is not None:
            found[op.index] = Mixing(op.index, op.name, op.name_stack, why)
        dim.update((t, d) for t, d in zip(op.outputs, out) if d is not None)
    for regions in graph.regions.values():  # a loop's predicate over several examples' values
        for r in regions:
            if wanted is not None and r.start not in wanted:
                continue
            if r.kind == "while" and not r.params["cond_jaxpr"].out_avals[0].shape:
                cn, bn = r.params["cond_nconsts"], r.params["body_nconsts"]
                operands = list(r.operands[:cn]) + list(r.operands[cn + bn:])
                read = [operands[k] for k in _predicate_reads(r.params["cond_jaxpr"].jaxpr)]
                if any(isinstance(t, int) and t in dim for t in read):
                    found[r.start] = Mixing(r.start, "while", graph.ops[r.start].name_stack if r.end > r.start else "",
                                            "stops on a predicate over several examples")
    if loss is not None:
        for i in _loss_reductions(graph, loss, dim, producers):
            found.pop(i, None)
    return tuple(found[i] for i in sorted(found))


def _loss_reductions(graph: Graph, loss: int, dim: dict[int, int], producers: dict[int, Op]) -> set[int]:
    """Ops through which `loss` is a sum of per-example terms scaled by example-free values."""
    out: set[int] = set()
    todo = [loss]
    while todo:
        op = producers.get(todo.pop())
        if op is None or op.name not in _LINEAR or op.index in out:
            continue
        if op.name in ("mul", "div") and sum(1 for x in op.inputs if isinstance(x, int) and
                                             (x in dim or _batch_derived(x, dim, producers))) > 1:
            continue  # a product of two example-dependent values is not a sum of per-example terms
        if op.name == "div" and isinstance(op.inputs[1], int) and _batch_derived(op.inputs[1], dim, producers):
            continue  # divided by a statistic of the batch (a token count): the mean is over all examples
        out.add(op.index)
        todo.extend(x for x in op.inputs if isinstance(x, int))
    return out


def _batch_derived(t: int, dim: dict[int, int], producers: dict[int, Op]) -> bool:
    """Whether `t` was computed from the batch (batched, or reduced from batched values)."""
    seen, todo = set(), [t]
    while todo:
        x = todo.pop()
        if x in dim:
            return True
        op = producers.get(x)
        if op is None or op.index in seen:
            continue
        seen.add(op.index)
        todo.extend(y for y in op.inputs if isinstance(y, int))
    return False


def _predicate_reads(jaxpr) -> list[int]:
    """Positions of the inputs a (while-loop predicate) jaxpr's result depends on."""
    needed = {v for v in jaxpr.outvars if not hasattr(v, "val")}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not hasattr(v, "val"))
    return [k for k, v in enumerate(jaxpr.invars) if v in needed]
