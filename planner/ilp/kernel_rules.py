"""Sharding rules of fused kernels: Pallas calls, kernels declared with `planner.register_kernel`
(`custom_partitioning`), and grouped matmuls (`jax.lax.ragged_dot`).

A Pallas kernel runs one program per point of its grid; each operand's BlockSpec index map says
which block of the operand a program reads. The grid axes along which the kernel is independent
(`graph.kernels.parallel_axes`) are dimensions each device can run the kernel on its shard of
(`emit.kernels`): those dimensions share one label per grid axis; every other dimension is whole
(None). A kernel with no such axis is planned replicated with one warning naming it and how to
declare it.

Cost: the kernel's own `cost_estimate` FLOPs where it has one, else its body's matmuls over the
grid (`graph.kernels.kernel_flops`). Bytes are the operands' and results' (the strategies charge
them); the kernel keeps no intermediate in device memory beyond its results.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from planner.core.compat import pallas_grid
from planner.graph.fusion import FUSED_ATTENTION_PLATFORMS, attention_calls, is_backward
from planner.graph.ir import Graph, Literal, Op
from planner.graph.kernels import jaxpr_flops, kernel_flops, matmul_dtypes, parallel_axes, sharding_rule_factors
from planner.ilp.opsig import Labels, OpSig, tensor_of

# How to say what the planner could not see in a kernel (one warning per kernel).
DECLARE = ("declare its parallel dimensions with planner.register_kernel(fn, in_axes=..., out_axes=...)")


def _replicated(op: Op, graph: Graph, why: str) -> OpSig:
    ins = tuple(None if isinstance(x, Literal) else (None,) * len(graph.tensors[x].shape) for x in op.inputs)
    outs = tuple((None,) * len(graph.tensors[t].shape) for t in op.outputs)
    return OpSig(ins, outs, {}, known=False, fallback=why)


# ----- Pallas -------------------------------------------------------------------------------------
def pallas_call_rule(op: Op, graph: Graph) -> OpSig:
    facts = pallas_grid(op.params)
    if facts is None:
        return _replicated(op, graph, f"kernel of pallas_call could not be read; {DECLARE}")
    axes, why = parallel_axes(facts)
    flops = facts.flops if facts.flops is not None else kernel_flops(facts)
    if not axes:
        return _replicated(op, graph, f"kernel {facts.name!r} has no dimension it is independent along ({why}); "
                                      f"{DECLARE}")
    wanted = set(axes)

    def labels(axes_of: Sequence[int | None]) -> Labels:
        return tuple(f"g{a}" if a in wanted else None for a in axes_of)

    n_in = len(facts.blocks) - facts.num_outputs
    lead = len(op.inputs) - n_in  # scalar-prefetch operands and run-time grid sizes come first
    ins: list[Labels | None] = []
    for k, x in enumerate(op.inputs):
        if isinstance(x, Literal):
            ins.append(None)
        elif k < lead:
            ins.append((None,) * len(graph.tensors[x].shape))
        else:
            ins.append(labels(facts.blocks[k - lead][1]))
    outs = tuple(labels(facts.blocks[n_in + j][1]) for j in range(len(op.outputs)))
    sizes = {f"g{a}": facts.grid[a] for a in axes}
    return OpSig(tuple(ins), outs, sizes, flops=float(flops), rate_dtypes=matmul_dtypes(facts.body))


# ----- kernels declared by the user (`planner.register_kernel`: a `custom_partitioning` call) ------
def custom_partitioning_rule(op: Op, graph: Graph) -> OpSig:
    """Labels from the call's sharding rule (its factors, as `SdyShardingRule` states them): a
    factor in every result is a dimension the kernel is independent along; any other factor (a
    compound one, one the results lack) stays whole. FLOPs: what the declaration states
    (`register_kernel(flops=)`), else the matmuls of the call's body."""
    name = getattr(op.params.get("partition"), "name", None) or getattr(op.params.get("partition"), "__name__", "?")
    found = sharding_rule_factors(op, graph)
    if isinstance(found, str):
        return _replicated(op, graph, f"custom_partitioning call {name!r}: {found}; {DECLARE}")
    ops_map, res_map, whole = found
    in_results = set.intersection(*(set(f for f in m if isinstance(f, str)) for m in res_map)) if res_map else set()
    in_results -= set(whole)
    sizes: dict[str, int] = {}

    def labels(mapping, shape) -> Labels:
        out = []
        for f, n in zip(mapping, shape):
            if isinstance(f, str) and f in in_results and n > 1:
                sizes[f] = n
                out.append(f)
            else:
                out.append(None)
        return tuple(out)

    arrays = [tensor_of(graph, x) for x in op.inputs]
    ins = tuple(None if isinstance(x, Literal) else labels(m, t.shape) for x, m, t in zip(op.inputs, ops_map, arrays))
    outs = tuple(labels(m, graph.tensors[t].shape) for m, t in zip(res_map, op.outputs))
    declared = getattr(op.params.get("partition"), "flops", None)
    if callable(declared):
        declared = declared(*(tuple(t.shape) for t in arrays))
    body = op.params.get("call")
    flops = declared if declared is not None else (jaxpr_flops(body.jaxpr) if body is not None else 0.0)
    if not sizes:
        return _replicated(op, graph, f"the sharding rule of {name!r} names no dimension in every result; " + DECLARE)
    return OpSig(ins, outs, sizes, flops=float(flops), rate_dtypes=matmul_dtypes(body.jaxpr) if body is not None else ())


# ----- grouped matmuls ------------------------------------------------------------------------------
def ragged_dot_rule(op: Op, graph: Graph) -> OpSig:
    """`ragged_dot_general`: the ragged dimension (rows grouped by `group_sizes`) and the groups stay
    whole (a shard would cut groups the sizes count globally); a contracted dimension that is not
    ragged may be split (partial sums), and so may the free dimensions of the right operand. Forms
    with batch dimensions are planned replicated."""
    dn = op.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    ragged, groups = tuple(dn.lhs_ragged_dimensions), tuple(dn.rhs_group_dimensions)
    if lb or rb or len(ragged) != 1:
        raise ValueError("ragged_dot_general with batch dimensions")
    lhs, rhs = tensor_of(graph, op.inputs[0]), tensor_of(graph, op.inputs[1])
    out = graph.tensors[op.outputs[0]]
    sizes: dict[str, int] = {}
    l_lab: list[str | None] = [None] * len(lhs.shape)
    r_lab: list[str | None] = [None] * len(rhs.shape)
    sums = set()
    for i, (a, b) in enumerate(zip(lc, rc)):
        if a not in ragged:
            l_lab[a] = r_lab[b] = f"k{i}"
            sizes[f"k{i}"] = lhs.shape[a]
            sums.add(f"k{i}")
    l_free = [d for d in range(len(lhs.shape)) if d not in lc]
    r_free = [d for d in range(len(rhs.shape)) if d not in rc and d not in groups]
    contracting_ragged = ragged[0] in lc
    out_lab: list[str | None] = [None] if contracting_ragged else []  # the groups, first
    for d in l_free:
        lab = None if d in ragged else f"m{d}"
        if lab:
            sizes[lab] = lhs.shape[d]
        l_lab[d] = lab
        out_lab.append(lab)
    for d in r_free:
        r_lab[d] = f"n{d}"
        sizes[f"n{d}"] = rhs.shape[d]
        out_lab.append(f"n{d}")
    if len(out_lab) != len(out.shape):
        raise ValueError("unexpected ragged_dot_general result rank")
    n = math.prod(rhs.shape[d] for d in r_free)
    ins: list[Labels | None] = [tuple(l_lab), tuple(r_lab)]
    ins += [None if isinstance(x, Literal) else (None,) * len(graph.tensors[x].shape) for x in op.inputs[2:]]
    return OpSig(tuple(ins), (tuple(out_lab),), sizes, frozenset(sums), flops=2.0 * lhs.size * n)


# What the fused attention of `jax.nn.dot_product_attention` is on each target platform.
_FUSED_ATTENTION_KERNEL = {"gpu": "cuDNN's fused flash attention", "tpu": "the splash / flash attention kernel"}


def kernel_notes(graph: Graph, platform: str) -> tuple[str, ...]:
    """One line per kind of fused kernel in `graph` (`Plan.kernels`): how it was priced for a
    target of `platform` and whether it runs on shards."""
    notes = []
    calls = attention_calls(graph)
    if calls:
        forward = {c for i, c in calls.items() if not is_backward(graph.ops[i].name_stack)}
        n = len(forward) or len(set(calls.values()))
        if platform in FUSED_ATTENTION_PLATFORMS:
            notes.append(f"jax.nn.dot_product_attention ({n} calls): priced as {_FUSED_ATTENTION_KERNEL[platform]} "
                         "(scores never in memory, masked blocks skipped, the backward recomputing the scores)")
        else:
            notes.append(f"jax.nn.dot_product_attention ({n} calls): priced as XLA's attention program on "
                         f"{platform} (scores materialised)")
    kinds: dict[str, list[OpSig]] = {}
    for op in graph.ops:
        if op.name in ("pallas_call", "custom_partitioning"):
            facts = pallas_grid(op.params) if op.name == "pallas_call" else None
            name = facts.name if facts is not None else getattr(op.params.get("partition"), "name", op.name)
            rule = pallas_call_rule if op.name == "pallas_call" else custom_partitioning_rule
            sig = rule(op, graph)
            kinds.setdefault(f"{op.name} {name!r}" + ("" if sig.known else " "), []).append(sig)
    for name, sigs in kinds.items():
        sig = sigs[0]
        if not sig.known:
            notes.append(f"{name} ({len(sigs)} ops): replicated, {sig.fallback}")
        else:
            notes.append(f"{name} ({len(sigs)} ops): on shards, split along {len(sig.sizes)} dimension(s), "
                         f"{sum(s.flops for s in sigs):.3g} FLOPs")
    return tuple(notes)


KERNEL_RULES = {
    "pallas_call": pallas_call_rule,
    "custom_partitioning": custom_partitioning_rule,
    "ragged_dot_general": ragged_dot_rule,
}
