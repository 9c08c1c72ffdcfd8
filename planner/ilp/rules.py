"""Per-primitive sharding rules, as einsum-like dimension labels.

A rule describes an op by labelling the dimensions of its operands and results. Dimensions that
share a label may be split by the same mesh axes; a label found only in operands and listed in
`sum_labels` is a contraction whose split leaves partial sums (an all-reduce, or a reduce-scatter if
the result is wanted sharded); a `None` label means "this dimension must not be split here".
Strategies on any N-D mesh are enumerated from labels alone (see `strategies.py`).

Primitives without a rule are planned replicated by `replicated_rule`, with a warning.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

from jax.sharding import PartitionSpec

from planner.core.compat import user_sharding
from planner.graph.ir import Graph, Literal, Op
from planner.ilp.index_rules import (
    conv_rule,
    dynamic_update_slice_rule,
    gather_rule,
    pool_keep,
    scatter_add_rule,
    scatter_rule,
    select_and_scatter_add_rule,
)
from planner.ilp.kernel_rules import KERNEL_RULES
from planner.ilp.opsig import Labels, OpSig, Rule, dim_labels, tensor_of
from planner.ilp.wire import accumulates

__all__ = ["ELEMENTWISE", "RULES", "Labels", "OpSig", "Rule", "replicated_rule", "signature"]

def replicated_rule(op: Op, graph: Graph) -> OpSig:
    """Fallback: every operand and result whole on every device."""
    ins = tuple(None if isinstance(x, Literal) else (None,) * len(graph.tensors[x].shape) for x in op.inputs)
    outs = tuple((None,) * len(graph.tensors[t].shape) for t in op.outputs)
    return OpSig(ins, outs, {}, known=False)


def elementwise_rule(op: Op, graph: Graph) -> OpSig:
    """n-ary elementwise: all non-scalar operands share the result's labels."""
    out = graph.tensors[op.outputs[0]]
    labels, sizes = dim_labels("d", out.shape)
    ins: list[Labels | None] = []
    for x in op.inputs:
        t = tensor_of(graph, x)
        if isinstance(x, Literal):
            ins.append(None)
        elif len(t.shape) == len(out.shape):  # size-1 dims broadcast implicitly
            ins.append(tuple(l if d == o else None for l, d, o in zip(labels, t.shape, out.shape)))
        else:  # scalar operand
            ins.append((None,) * len(t.shape))
    outs = tuple(labels for _ in op.outputs)
    return OpSig(tuple(ins), outs, sizes, flops=float(out.size))


def dot_general_rule(op: Op, graph: Graph) -> OpSig:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = tensor_of(graph, op.inputs[0]), tensor_of(graph, op.inputs[1])
    sizes: dict[str, int] = {}
    l_lab: list[str | None] = [None] * len(lhs.shape)
    r_lab: list[str | None] = [None] * len(rhs.shape)
    out: list[str] = []
    for i, (a, b) in enumerate(zip(lb, rb)):
        l_lab[a] = r_lab[b] = f"b{i}"
        sizes[f"b{i}"] = lhs.shape[a]
        out.append(f"b{i}")
    for i, (a, b) in enumerate(zip(lc, rc)):
        l_lab[a] = r_lab[b] = f"k{i}"
        sizes[f"k{i}"] = lhs.shape[a]
    for d in range(len(lhs.shape)):
        if l_lab[d] is None:
            l_lab[d] = f"m{d}"
            sizes[f"m{d}"] = lhs.shape[d]
            out.append(f"m{d}")
    for d in range(len(rhs.shape)):
        if r_lab[d] is None:
            r_lab[d] = f"n{d}"
            sizes[f"n{d}"] = rhs.shape[d]
            out.append(f"n{d}")
    flops = 2.0 * math.prod(sizes.values())
    return OpSig((tuple(l_lab), tuple(r_lab)), (tuple(out),), sizes,
                 sum_labels=frozenset(f"k{i}" for i in range(len(lc))), flops=flops,
                 accumulates=accumulates(graph.tensors[op.outputs[0]].dtype))


def _reduce_rule(summable: bool) -> Rule:
    def rule(op: Op, graph: Graph) -> OpSig:
        x = graph.tensors[op.inputs[0]]
        axes = set(op.params["axes"])
        labels, sizes = dim_labels("d", x.shape)
        out = tuple(l for i, l in enumerate(labels) if i not in axes)
        in_labels = tuple(l if (summable or i not in axes) else None for i, l in enumerate(labels))
        sums = frozenset(labels[i] for i in axes) if summable else frozenset()
        return OpSig((in_labels,), (out,), sizes, sum_labels=sums, flops=float(x.size))
    return rule


def argminmax_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    axes = set(op.params["axes"])
    labels, sizes = dim_labels("d", x.shape)
    in_labels = tuple(None if i in axes else l for i, l in enumerate(labels))
    out = tuple(l for i, l in enumerate(labels) if i not in axes)
    return OpSig((in_labels,), (out,), sizes, flops=float(x.size))


def broadcast_in_dim_rule(op: Op, graph: Graph) -> OpSig:
    shape = tuple(op.params["shape"])
    bdims = tuple(op.params["broadcast_dimensions"])
    labels, sizes = dim_labels("d", shape)
    x = op.inputs[0]
    if isinstance(x, Literal):
        ins: tuple[Labels | None, ...] = (None,)
    else:
        xs = graph.tensors[x].shape
        ins = (tuple(labels[o] if xs[i] == shape[o] else None for i, o in enumerate(bdims)),)
    extra = tuple(None if isinstance(v, Literal) else (None,) * len(graph.tensors[v].shape) for v in op.inputs[1:])
    return OpSig(ins + extra, (labels,), sizes, flops=0.0)


def transpose_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    labels, sizes = dim_labels("d", x.shape)
    perm = op.params["permutation"]
    return OpSig((labels,), (tuple(labels[p] for p in perm),), sizes, flops=float(x.size))


def _reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Splits two shapes of equal size into runs of dims with equal products."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [i] if i < len(a) else [], [j] if j < len(b) else []
        pa = a[i] if i < len(a) else 1
        pb = b[j] if j < len(b) else 1
        i, j = i + bool(gi), j + bool(gj)
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def reshape_rule(op: Op, graph: Graph) -> OpSig:
    """Merges and splits keep a split on the major dimension of each group of matching sizes."""
    x = graph.tensors[op.inputs[0]]
    out_shape = tuple(op.params["new_sizes"])
    in_labels: list[str | None] = [None] * len(x.shape)
    out_labels: list[str | None] = [None] * len(out_shape)
    sizes: dict[str, int] = {}
    for k, (gi, gj) in enumerate(_reshape_groups(x.shape, out_shape)):
        gi = [d for d in gi if x.shape[d] > 1]
        gj = [d for d in gj if out_shape[d] > 1]
        if not gi or not gj:
            continue
        size = math.gcd(x.shape[gi[0]], out_shape[gj[0]])
        if size > 1:
            in_labels[gi[0]] = out_labels[gj[0]] = f"g{k}"
            sizes[f"g{k}"] = size
    extra = tuple(None if isinstance(v, Literal) else (None,) * len(graph.tensors[v].shape) for v in op.inputs[1:])
    return OpSig((tuple(in_labels),) + extra, (tuple(out_labels),), sizes, flops=0.0)


def squeeze_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    labels, sizes = dim_labels("d", x.shape)
    dims = set(d % len(x.shape) for d in op.params["dimensions"])
    return OpSig((labels,), (tuple(l for i, l in enumerate(labels) if i not in dims),), sizes)


def expand_dims_rule(op: Op, graph: Graph) -> OpSig:
    out = graph.tensors[op.outputs[0]]
    x = graph.tensors[op.inputs[0]]
    labels, sizes = dim_labels("d", x.shape)
    dims = set(op.params["dimensions"])
    it = iter(labels)
    out_labels = tuple(None if i in dims else next(it) for i in range(len(out.shape)))
    return OpSig((labels,), (out_labels,), sizes)


def _window_rule(keep: Callable[[Op, int, int], bool]) -> Rule:
    """Ops that cut windows from operand 0: dims where `keep(op, dim, size)` pass through; the
    result's other dims get fresh labels (splitting them needs the operand whole there)."""

    def rule(op: Op, graph: Graph) -> OpSig:
        x = graph.tensors[op.inputs[0]]
        out = graph.tensors[op.outputs[0]]
        sizes: dict[str, int] = {}
        in_l: list[str | None] = []
        out_l: list[str | None] = []
        for d, (si, so) in enumerate(zip(x.shape, out.shape)):
            if si == so and keep(op, d, si):
                in_l.append(f"d{d}")
                out_l.append(f"d{d}")
                sizes[f"d{d}"] = si
            else:
                in_l.append(None)
                out_l.append(f"o{d}")
                sizes[f"o{d}"] = so
        rest = tuple(None if isinstance(v, Literal) else (None,) * len(graph.tensors[v].shape) for v in op.inputs[1:])
        return OpSig((tuple(in_l),) + rest, (tuple(out_l),), sizes, flops=float(out.size))

    return rule


def _slice_keep(op: Op, d: int, size: int) -> bool:
    start, limit = op.params["start_indices"][d], op.params["limit_indices"][d]
    strides = op.params.get("strides")
    return start == 0 and limit == size and (strides is None or strides[d] == 1)


def _cum_keep(op: Op, d: int, size: int) -> bool:
    return d != op.params["axis"]


def _pad_keep(op: Op, d: int, size: int) -> bool:
    lo, hi, interior = op.params["padding_config"][d]
    return lo == hi == interior == 0


def _rev_keep(op: Op, d: int, size: int) -> bool:
    return d not in op.params["dimensions"]


def concatenate_rule(op: Op, graph: Graph) -> OpSig:
    out = graph.tensors[op.outputs[0]]
    axis = op.params["dimension"]
    labels, sizes = dim_labels("d", out.shape)
    in_l = tuple(None if i == axis else l for i, l in enumerate(labels))
    ins = tuple(None if isinstance(v, Literal) else in_l for v in op.inputs)
    return OpSig(ins, (labels,), sizes, flops=float(out.size))


def stack_rule(op: Op, graph: Graph) -> OpSig:
    """Stacking along a new dim: operand dims pass through; the new dim may be split freely
    (each device keeps the slices it holds)."""
    out = graph.tensors[op.outputs[0]]
    axis = op.params["axis"] % len(out.shape)
    labels, sizes = dim_labels("d", out.shape)
    in_l = tuple(l for i, l in enumerate(labels) if i != axis)
    ins = tuple(None if isinstance(v, Literal) else in_l for v in op.inputs)
    return OpSig(ins, (labels,), sizes, flops=float(out.size))


def iota_rule(op: Op, graph: Graph) -> OpSig:
    labels, sizes = dim_labels("d", graph.tensors[op.outputs[0]].shape)
    return OpSig((), (labels,), sizes)


def _all_but(dims_of: Callable[[Op, int], set[int]]) -> Rule:
    """Multi-operand/multi-result ops that keep every dim but some (sort, top_k, split)."""

    def rule(op: Op, graph: Graph) -> OpSig:
        x = graph.tensors[op.inputs[0]]
        skip = dims_of(op, len(x.shape))
        labels = tuple(None if d in skip else f"d{d}" for d in range(len(x.shape)))
        sizes = {f"d{d}": x.shape[d] for d in range(len(x.shape)) if d not in skip}
        ins = tuple(None if isinstance(v, Literal) else labels for v in op.inputs)
        outs = tuple(labels for _ in op.outputs)
        return OpSig(ins, outs, sizes, flops=float(x.size))

    return rule


def random_bits_rule(op: Op, graph: Graph) -> OpSig:
    """Random bits from a key (or a batch of keys, whose dims lead the result): the result may be
    split (JAX's threefry is partitionable, so each device generates its slice of the same numbers)."""
    labels, sizes = dim_labels("d", graph.tensors[op.outputs[0]].shape)
    key = graph.tensors[op.inputs[0]]
    return OpSig((labels[:len(key.shape)],), (labels,), sizes)  # a batch of keys: its dims lead the result


def _pins(labels, spec) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """label -> mesh axis names of a `PartitionSpec` (dims it leaves out or marks UNCONSTRAINED: free)."""
    out = []
    for lab, entry in zip(labels, tuple(spec) + (None,) * (len(labels) - len(spec))):
        if entry is PartitionSpec.UNCONSTRAINED:
            continue
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append((lab, names))
    return tuple(out)


def user_constraint_rule(op: Op, graph: Graph) -> OpSig:
    """The user's `with_sharding_constraint` / `jax.sharding.reshard`: the result takes the user's
    spec (a pin: the operand is resharded into it), unless the step was traced with
    `user_constraints="hint"`, when the op keeps its operand's sharding and the planner decides."""
    x = op.inputs[0]
    labels, sizes = dim_labels("d", tensor_of(graph, x).shape)
    ins = (None if isinstance(x, Literal) else labels,)
    if graph.user_constraints == "hint":
        return OpSig(ins, (labels,), sizes)
    spec = user_sharding(op.params).spec
    where = f"the sharding constraint {spec} at {op.name_stack or 'top level'}"
    return OpSig(ins, (labels,), sizes, pinned=_pins(labels, spec), where=where)


def shard_map_rule(op: Op, graph: Graph) -> OpSig:
    """A `shard_map` region, opaque to the planner: its operands and results take the layouts of
    its in/out specs (the planner reshards into and out of it and plans everything around it)."""
    p = op.params
    ins, outs, pins, sizes = [], [], [], {}
    for tag, xs, specs, acc in (("i", op.inputs, p["in_specs"], ins), ("o", op.outputs, p["out_specs"], outs)):
        for k, (x, spec) in enumerate(zip(xs, specs)):
            if isinstance(x, Literal):
                acc.append(None)
                continue
            labels, s = dim_labels(f"{tag}{k}_", graph.tensors[x].shape)
            sizes.update(s)
            pins.extend(_pins(labels, spec))
            acc.append(labels)
    return OpSig(tuple(ins), tuple(outs), sizes, pinned=tuple(pins),
                 where=f"shard_map at {op.name_stack or 'top level'}")


def unstack_rule(op: Op, graph: Graph) -> OpSig:
    """`unstack` (the transpose of `stack`, e.g. in RoPE's backward): the unstacked dim stays whole,
    the others pass through to every result."""
    x = graph.tensors[op.inputs[0]]
    axis = op.params["axis"] % len(x.shape)
    labels, sizes = dim_labels("d", x.shape)
    out = tuple(l for i, l in enumerate(labels) if i != axis)
    return OpSig((tuple(None if i == axis else l for i, l in enumerate(labels)),), tuple(out for _ in op.outputs),
                 sizes, flops=0.0)


def identity_each_rule(op: Op, graph: Graph) -> OpSig:
    """Ops that pass every operand through to the matching result (`optimization_barrier`, which
    remat emits): each operand keeps its own dims."""
    ins, sizes = [], {}
    for k, x in enumerate(op.inputs):
        if isinstance(x, Literal):
            ins.append(None)
            continue
        labels, s = dim_labels(f"o{k}_", graph.tensors[x].shape)
        sizes.update(s)
        ins.append(labels)
    outs = tuple(lab if lab is not None else () for lab in ins)
    return OpSig(tuple(ins), outs, sizes)


def key_batch_rule(op: Op, graph: Graph) -> OpSig:
    """PRNG key ops (`random_wrap`, `random_unwrap`, `random_split`, `random_fold_in`, `random_seed`):
    the leading dims the result shares with the first operand pass through (a batch of keys may be
    split); trailing dims that differ (key data words, a split's new dims) stay whole."""
    x, out = tensor_of(graph, op.inputs[0]), graph.tensors[op.outputs[0]]
    sizes: dict[str, int] = {}
    in_l: list[str | None] = [None] * len(x.shape)
    out_l: list[str | None] = [None] * len(out.shape)
    for d, (a, b) in enumerate(zip(x.shape, out.shape)):
        if a != b:
            break
        in_l[d] = out_l[d] = f"d{d}"
        sizes[f"d{d}"] = a
    rest = []
    for v in op.inputs[1:]:  # fold_in's data: broadcast like an elementwise operand
        t = tensor_of(graph, v)
        rest.append(None if isinstance(v, Literal) else tuple(out_l[d] if len(t.shape) == len(out.shape) and
                                                              t.shape[d] == out.shape[d] else None
                                                              for d in range(len(t.shape))))
    first = None if isinstance(op.inputs[0], Literal) else tuple(in_l)
    return OpSig((first,) + tuple(rest), (tuple(out_l),), sizes, flops=float(out.size))


def bitcast_rule(op: Op, graph: Graph) -> OpSig:
    if graph.tensors[op.inputs[0]].shape != graph.tensors[op.outputs[0]].shape:
        return replicated_rule(op, graph)
    return elementwise_rule(op, graph)


ELEMENTWISE = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "neg", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh",
    "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil", "round",
    "is_finite", "not", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "convert_element_type",
    "integer_pow", "square", "erf", "erfc", "erf_inv", "lgamma", "digamma", "nextafter", "clamp",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "imag", "real",
    "conj", "reduce_precision", "copy", "copy_p", "stop_gradient", "select_n", "tan", "polygamma",
    "igamma", "igammac", "bessel_i0e", "bessel_i1e", "random_gamma_grad", "clz", "logaddexp",
    "cosh", "exp2", "sinh", "tanh", "logistic",
    "one_minus_square",  # jax >= 0.11: 1 - x^2, the tanh derivative in the backward
)

RULES: Mapping[str, Rule] = MappingProxyType({
    **{name: elementwise_rule for name in ELEMENTWISE},
    "dot_general": dot_general_rule,
    "reduce_sum": _reduce_rule(True),
    "reduce_max": _reduce_rule(True),
    "reduce_min": _reduce_rule(True),
    "reduce_prod": _reduce_rule(True),
    "reduce_and": _reduce_rule(True),
    "reduce_or": _reduce_rule(True),
    "argmax": argminmax_rule,
    "argmin": argminmax_rule,
    "broadcast_in_dim": broadcast_in_dim_rule,
    "transpose": transpose_rule,
    "reshape": reshape_rule,
    "squeeze": squeeze_rule,
    "expand_dims": expand_dims_rule,
    "slice": _window_rule(_slice_keep),
    "dynamic_slice": _window_rule(lambda op, d, s: True),
    "cumsum": _window_rule(_cum_keep),
    "cumprod": _window_rule(_cum_keep),
    "cummax": _window_rule(_cum_keep),
    "cummin": _window_rule(_cum_keep),
    "cumlogsumexp": _window_rule(_cum_keep),
    "pad": _window_rule(_pad_keep),
    "rev": _window_rule(_rev_keep),
    "concatenate": concatenate_rule,
    "iota": iota_rule,
    "stack": stack_rule,
    "dynamic_update_slice": dynamic_update_slice_rule,
    "gather": gather_rule,
    "scatter-add": scatter_add_rule,
    "scatter_add": scatter_add_rule,
    "scatter": scatter_rule,
    "scatter-mul": scatter_rule,
    "scatter_mul": scatter_rule,
    "scatter-min": scatter_rule,
    "scatter_min": scatter_rule,
    "scatter-max": scatter_rule,
    "scatter_max": scatter_rule,
    "conv_general_dilated": conv_rule,
    "reduce_window_sum": _window_rule(pool_keep),
    "reduce_window_max": _window_rule(pool_keep),
    "reduce_window_min": _window_rule(pool_keep),
    "reduce_window": _window_rule(pool_keep),
    "select_and_scatter_add": select_and_scatter_add_rule,
    "sort": _all_but(lambda op, n: {op.params["dimension"] % n}),
    "top_k": _all_but(lambda op, n: {n - 1}),
    "split": _all_but(lambda op, n: {op.params["axis"] % n}),
    "random_bits": random_bits_rule,
    "random_wrap": key_batch_rule,
    "random_unwrap": key_batch_rule,
    "random_split": key_batch_rule,
    "random_fold_in": key_batch_rule,
    "random_seed": key_batch_rule,
    "unstack": unstack_rule,
    "optimization_barrier": identity_each_rule,
    "name": elementwise_rule,  # checkpoint_name: identity, evaluated as itself so remat policies see it
    "threefry2x32": elementwise_rule,
    "bitcast_convert_type": bitcast_rule,
    "sharding_constraint": user_constraint_rule,
    "reshard": user_constraint_rule,
    "shard_map": shard_map_rule,
    **KERNEL_RULES,
})


def signature(op: Op, graph: Graph, rules: Mapping[str, Rule] = RULES) -> OpSig:
    """The op's labels from its rule; the replicated fallback for unknown primitives or rule errors.
    With the default rules, computed once per op of the graph (`Graph.cached`)."""
    if rules is RULES and 0 <= op.index < len(graph.ops) and graph.ops[op.index] is op:
        memo = graph.cached("signatures", dict)
        sig = memo.get(op.index)
        if sig is None:
            sig = memo[op.index] = _signature(op, graph, rules)
        return sig
    return _signature(op, graph, rules)


def _signature(op: Op, graph: Graph, rules: Mapping[str, Rule]) -> OpSig:
    rule = rules.get(op.name)
    if rule is None:
        return replicated_rule(op, graph)
    try:
        return rule(op, graph)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return replicated_rule(op, graph)
