"""Per-primitive sharding rules, as einsum-like dimension labels.

A rule describes an op by labelling the dimensions of its operands and results. Dimensions that
share a label may be split by the same mesh axes; a label found only in operands and listed in
`sum_labels` is a contraction whose split leaves partial sums (an all-reduce, or a reduce-scatter if
the result is wanted sharded); a `None` label means "this dimension must not be split here".
Strategies on any N-D mesh are enumerated from labels alone (see `strategies.py`).

Primitives without a rule are planned replicated by `replicated_rule`, with a warning.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

from planner.graph import Graph, Literal, Op, Tensor

Labels = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OpSig:
    """Dimension labels of one op.

    Attributes:
      inputs: labels per operand dimension; `None` for a literal operand.
      outputs: labels per result dimension.
      sizes: extent of each label (for reshape merges, the extent that a split must divide).
      sum_labels: contracted labels whose split yields partial results.
      flops: floating-point operations of the op (for the compute model).
      known: False when produced by the replicated fallback.
    """

    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    sizes: Mapping[str, int]
    sum_labels: frozenset[str] = frozenset()
    flops: float = 0.0
    known: bool = True

    def shardable(self) -> tuple[str, ...]:
        """Labels a mesh axis may be assigned to, in a fixed order."""
        out_labels = {l for labels in self.outputs for l in labels if l is not None}
        return tuple(sorted(l for l in self.sizes if l in out_labels or l in self.sum_labels))


Rule = Callable[[Op, Graph], OpSig]


def _t(graph: Graph, x: int | Literal) -> Tensor:
    return x.tensor if isinstance(x, Literal) else graph.tensors[x]


def _dims(prefix: str, shape: tuple[int, ...]) -> tuple[Labels, dict[str, int]]:
    labels = tuple(f"{prefix}{i}" for i in range(len(shape)))
    return labels, {l: s for l, s in zip(labels, shape)}


def replicated_rule(op: Op, graph: Graph) -> OpSig:
    """Fallback: every operand and result whole on every device."""
    ins = tuple(None if isinstance(x, Literal) else (None,) * len(graph.tensors[x].shape) for x in op.inputs)
    outs = tuple((None,) * len(graph.tensors[t].shape) for t in op.outputs)
    return OpSig(ins, outs, {}, known=False)


def elementwise_rule(op: Op, graph: Graph) -> OpSig:
    """n-ary elementwise: all non-scalar operands share the result's labels."""
    out = graph.tensors[op.outputs[0]]
    labels, sizes = _dims("d", out.shape)
    ins: list[Labels | None] = []
    for x in op.inputs:
        t = _t(graph, x)
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
    lhs, rhs = _t(graph, op.inputs[0]), _t(graph, op.inputs[1])
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
                 sum_labels=frozenset(f"k{i}" for i in range(len(lc))), flops=flops)


def _reduce_rule(summable: bool) -> Rule:
    def rule(op: Op, graph: Graph) -> OpSig:
        x = graph.tensors[op.inputs[0]]
        axes = set(op.params["axes"])
        labels, sizes = _dims("d", x.shape)
        out = tuple(l for i, l in enumerate(labels) if i not in axes)
        in_labels = tuple(l if (summable or i not in axes) else None for i, l in enumerate(labels))
        sums = frozenset(labels[i] for i in axes) if summable else frozenset()
        return OpSig((in_labels,), (out,), sizes, sum_labels=sums, flops=float(x.size))
    return rule


def argminmax_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    axes = set(op.params["axes"])
    labels, sizes = _dims("d", x.shape)
    in_labels = tuple(None if i in axes else l for i, l in enumerate(labels))
    out = tuple(l for i, l in enumerate(labels) if i not in axes)
    return OpSig((in_labels,), (out,), sizes, flops=float(x.size))


def broadcast_in_dim_rule(op: Op, graph: Graph) -> OpSig:
    shape = tuple(op.params["shape"])
    bdims = tuple(op.params["broadcast_dimensions"])
    labels, sizes = _dims("d", shape)
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
    labels, sizes = _dims("d", x.shape)
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
    labels, sizes = _dims("d", x.shape)
    dims = set(d % len(x.shape) for d in op.params["dimensions"])
    return OpSig((labels,), (tuple(l for i, l in enumerate(labels) if i not in dims),), sizes)


def expand_dims_rule(op: Op, graph: Graph) -> OpSig:
    out = graph.tensors[op.outputs[0]]
    x = graph.tensors[op.inputs[0]]
    labels, sizes = _dims("d", x.shape)
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
    labels, sizes = _dims("d", out.shape)
    in_l = tuple(None if i == axis else l for i, l in enumerate(labels))
    ins = tuple(None if isinstance(v, Literal) else in_l for v in op.inputs)
    return OpSig(ins, (labels,), sizes, flops=float(out.size))


def stack_rule(op: Op, graph: Graph) -> OpSig:
    """Stacking along a new dim: operand dims pass through; the new dim may be split freely
    (each device keeps the slices it holds)."""
    out = graph.tensors[op.outputs[0]]
    axis = op.params["axis"] % len(out.shape)
    labels, sizes = _dims("d", out.shape)
    in_l = tuple(l for i, l in enumerate(labels) if i != axis)
    ins = tuple(None if isinstance(v, Literal) else in_l for v in op.inputs)
    return OpSig(ins, (labels,), sizes, flops=float(out.size))


def iota_rule(op: Op, graph: Graph) -> OpSig:
    labels, sizes = _dims("d", graph.tensors[op.outputs[0]].shape)
    return OpSig((), (labels,), sizes)


def dynamic_update_slice_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    upd = graph.tensors[op.inputs[1]]
    labels, sizes = _dims("d", x.shape)
    shared = tuple(l if su == sx else None for l, sx, su in zip(labels, x.shape, upd.shape))
    rest = tuple(None if isinstance(v, Literal) else () for v in op.inputs[2:])
    return OpSig((shared, shared) + rest, (shared,), sizes, flops=float(upd.size))


def gather_rule(op: Op, graph: Graph) -> OpSig:
    """Gathers such as embedding lookups: index batch dims and whole slice dims pass through."""
    dn = op.params["dimension_numbers"]
    operand, indices = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    out = graph.tensors[op.outputs[0]]
    slice_sizes = tuple(op.params["slice_sizes"])
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    start_map = set(dn.start_index_map)
    sizes: dict[str, int] = {}
    o_lab: list[str | None] = [None] * len(operand.shape)
    i_lab: list[str | None] = [None] * len(indices.shape)
    out_lab: list[str | None] = [None] * len(out.shape)
    # Result dims that are not offset dims enumerate index batch dims in order (index_vector_dim last).
    batch_out = [d for d in range(len(out.shape)) if d not in offset_dims]
    idx_dims = list(range(len(indices.shape) - 1))
    for od, idim in zip(batch_out, idx_dims):
        lab = f"i{idim}"
        i_lab[idim] = out_lab[od] = lab
        sizes[lab] = indices.shape[idim]
        if idim in idx_batch:
            o_lab[op_batch[idx_batch.index(idim)]] = lab
    window = [d for d in range(len(operand.shape)) if d not in collapsed and d not in op_batch]
    for od, wd in zip(offset_dims, window):
        if slice_sizes[wd] == operand.shape[wd] and wd not in start_map:
            lab = f"w{wd}"
            o_lab[wd] = out_lab[od] = lab
            sizes[lab] = operand.shape[wd]
    # A looked-up dim (e.g. the vocabulary of an embedding table) may be split: each device looks
    # up the rows it holds and contributes zeros for the others, leaving partial sums.
    sums = set()
    for d in collapsed & start_map:
        if slice_sizes[d] == 1 and o_lab[d] is None:
            lab = f"v{d}"
            o_lab[d] = lab
            sizes[lab] = operand.shape[d]
            sums.add(lab)
    return OpSig((tuple(o_lab), tuple(i_lab)), (tuple(out_lab),), sizes, sum_labels=frozenset(sums),
                 flops=float(out.size))


def scatter_rule(op: Op, graph: Graph) -> OpSig:
    """Scatters that overwrite (or take min/max/product): window dims pass through, the scattered
    dims stay whole (updates landing on the same row from different devices do not combine)."""
    sig = scatter_add_rule(op, graph)
    ins = list(sig.inputs)
    ins[1] = tuple(None for _ in ins[1])  # indices whole
    ins[2] = tuple(None if l in sig.sum_labels else l for l in ins[2])  # updates whole on scatter dims
    return dataclasses.replace(sig, inputs=tuple(ins), sum_labels=frozenset())


def scatter_add_rule(op: Op, graph: Graph) -> OpSig:
    """Scatter-add (embedding gradients): split update batch dims leave partial sums."""
    dn = op.params["dimension_numbers"]
    operand, indices, updates = (graph.tensors[x] for x in op.inputs[:3])
    window_dims = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    sdims_to_op = set(dn.scatter_dims_to_operand_dims)
    sizes: dict[str, int] = {}
    o_lab: list[str | None] = [None] * len(operand.shape)
    i_lab: list[str | None] = [None] * len(indices.shape)
    u_lab: list[str | None] = [None] * len(updates.shape)
    scatter_dims = [d for d in range(len(updates.shape)) if d not in window_dims]
    sums = set()
    for ud, idim in zip(scatter_dims, range(len(indices.shape) - 1)):
        lab = f"s{idim}"
        u_lab[ud] = i_lab[idim] = lab
        sizes[lab] = updates.shape[ud]
        if idim in idx_batch:
            o_lab[op_batch[idx_batch.index(idim)]] = lab
        else:
            sums.add(lab)
    window = [d for d in range(len(operand.shape)) if d not in inserted and d not in op_batch]
    for ud, wd in zip(window_dims, window):
        if updates.shape[ud] == operand.shape[wd] and wd not in sdims_to_op:
            lab = f"w{wd}"
            o_lab[wd] = u_lab[ud] = lab
            sizes[lab] = operand.shape[wd]
    # A scattered-into dim of the operand (an embedding gradient's vocabulary) may be split: each
    # device applies the updates that land in the rows it holds.
    for d in inserted & sdims_to_op:
        if o_lab[d] is None:
            lab = f"v{d}"
            o_lab[d] = lab
            sizes[lab] = operand.shape[d]
    return OpSig((tuple(o_lab), tuple(i_lab), tuple(u_lab)), (tuple(o_lab),), sizes,
                 sum_labels=frozenset(sums), flops=float(updates.size))


def conv_rule(op: Op, graph: Graph) -> OpSig:
    """Convolution: batch and output-feature splits pass through; a split input feature leaves
    partial sums. Spatial dims stay whole (no halo exchange)."""
    dn = op.params["dimension_numbers"]
    lhs, rhs = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    out = graph.tensors[op.outputs[0]]
    groups = op.params.get("feature_group_count", 1)
    bgroups = op.params.get("batch_group_count", 1)
    l_lab: list[str | None] = [None] * len(lhs.shape)
    r_lab: list[str | None] = [None] * len(rhs.shape)
    o_lab: list[str | None] = [None] * len(out.shape)
    sizes: dict[str, int] = {}
    sums = set()
    if bgroups == 1:
        l_lab[dn.lhs_spec[0]] = o_lab[dn.out_spec[0]] = "b"
        sizes["b"] = lhs.shape[dn.lhs_spec[0]]
    if groups == 1 and bgroups == 1:
        r_lab[dn.rhs_spec[0]] = o_lab[dn.out_spec[1]] = "o"
        sizes["o"] = rhs.shape[dn.rhs_spec[0]]
        l_lab[dn.lhs_spec[1]] = r_lab[dn.rhs_spec[1]] = "c"
        sizes["c"] = lhs.shape[dn.lhs_spec[1]]
        sums.add("c")
    window = math.prod(rhs.shape[d] for d in dn.rhs_spec[2:])
    flops = 2.0 * out.size * window * rhs.shape[dn.rhs_spec[1]]
    return OpSig((tuple(l_lab), tuple(r_lab)), (tuple(o_lab),), sizes, sum_labels=frozenset(sums), flops=flops)


def _pool_keep(op: Op, d: int, size: int) -> bool:
    pad = op.params["padding"][d]
    return (op.params["window_dimensions"][d] == 1 and op.params["window_strides"][d] == 1
            and tuple(pad) == (0, 0))


def select_and_scatter_add_rule(op: Op, graph: Graph) -> OpSig:
    """Max-pool gradient: dims with a unit window pass through (source, operand and result)."""
    source, operand = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    sizes: dict[str, int] = {}
    s_lab, o_lab = [], []
    for d in range(len(operand.shape)):
        if _pool_keep(op, d, operand.shape[d]) and source.shape[d] == operand.shape[d]:
            s_lab.append(f"d{d}")
            o_lab.append(f"d{d}")
            sizes[f"d{d}"] = operand.shape[d]
        else:
            s_lab.append(None)
            o_lab.append(None)
    rest = tuple(None if isinstance(v, Literal) else () for v in op.inputs[2:])
    return OpSig((tuple(s_lab), tuple(o_lab)) + rest, (tuple(o_lab),), sizes, flops=float(operand.size))


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
    """Random bits from a single key: the result may be split (JAX's threefry is partitionable, so
    each device generates its slice of the same numbers); the key stays whole."""
    labels, sizes = _dims("d", graph.tensors[op.outputs[0]].shape)
    key = graph.tensors[op.inputs[0]]
    if key.shape:
        return replicated_rule(op, graph)
    return OpSig(((),), (labels,), sizes)


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
    "reduce_window_sum": _window_rule(_pool_keep),
    "reduce_window_max": _window_rule(_pool_keep),
    "reduce_window_min": _window_rule(_pool_keep),
    "reduce_window": _window_rule(_pool_keep),
    "select_and_scatter_add": select_and_scatter_add_rule,
    "sort": _all_but(lambda op, n: {op.params["dimension"] % n}),
    "top_k": _all_but(lambda op, n: {n - 1}),
    "split": _all_but(lambda op, n: {op.params["axis"] % n}),
    "random_bits": random_bits_rule,
    "threefry2x32": elementwise_rule,
    "bitcast_convert_type": bitcast_rule,
})


def signature(op: Op, graph: Graph, rules: Mapping[str, Rule] = RULES) -> OpSig:
    """The op's labels from its rule; the replicated fallback for unknown primitives or rule errors."""
    rule = rules.get(op.name)
    if rule is None:
        return replicated_rule(op, graph)
    try:
        return rule(op, graph)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return replicated_rule(op, graph)
