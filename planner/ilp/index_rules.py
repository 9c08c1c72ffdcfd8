"""Sharding rules of indexed and windowed ops: dynamic_update_slice, gather, scatter, scatter-add,
convolution and the pooling gradient (select_and_scatter_add). Registered in `rules.RULES`."""
from __future__ import annotations

import dataclasses
import math

from planner.graph.ir import Graph, Literal, Op
from planner.ilp.opsig import OpSig, dim_labels
from planner.ilp.wire import accumulates


def dynamic_update_slice_rule(op: Op, graph: Graph) -> OpSig:
    x = graph.tensors[op.inputs[0]]
    upd = graph.tensors[op.inputs[1]]
    labels, sizes = dim_labels("d", x.shape)
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
    return OpSig((tuple(l_lab), tuple(r_lab)), (tuple(o_lab),), sizes, sum_labels=frozenset(sums), flops=flops,
                 accumulates=accumulates(graph.tensors[op.outputs[0]].dtype))


def pool_keep(op: Op, d: int, size: int) -> bool:
    pad = op.params["padding"][d]
    return (op.params["window_dimensions"][d] == 1 and op.params["window_strides"][d] == 1
            and tuple(pad) == (0, 0))


def select_and_scatter_add_rule(op: Op, graph: Graph) -> OpSig:
    """Max-pool gradient: dims with a unit window pass through (source, operand and result)."""
    source, operand = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    sizes: dict[str, int] = {}
    s_lab, o_lab = [], []
    for d in range(len(operand.shape)):
        if pool_keep(op, d, operand.shape[d]) and source.shape[d] == operand.shape[d]:
            s_lab.append(f"d{d}")
            o_lab.append(f"d{d}")
            sizes[f"d{d}"] = operand.shape[d]
        else:
            s_lab.append(None)
            o_lab.append(None)
    rest = tuple(None if isinstance(v, Literal) else () for v in op.inputs[2:])
    return OpSig((tuple(s_lab), tuple(o_lab)) + rest, (tuple(o_lab),), sizes, flops=float(operand.size))
