"""Sharding rules of fused kernels: Pallas calls, kernels declared with `planner.register_kernel`
(`custom_partitioning`), and grouped matmuls (`jax.lax.ragged_dot`).

A Pallas kernel runs one program per point of its grid; each operand's BlockSpec index map says
which block of the operand a program reads. A grid axis whose program id is, one to one, the block
index of one dimension of every result (and of whichever operands it indexes), whose blocks tile
those dimensions exactly, which the kernel body never reads (`program_id` / `num_programs`: a
causal mask's offset would be wrong on a shard) and which the compiler parameters do not call
"arbitrary", is a dimension along which the kernel is independent: each device can run the kernel
on its shard of it (`emit.kernels`). Those dimensions share one label per grid axis; every other
dimension is whole (None). A kernel with no such axis is planned replicated with one warning
naming it and how to declare it.

Cost: the kernel's own `cost_estimate` FLOPs where it has one; else the matmuls of its body
counted per program, loops by their trip counts (evaluated for every program id: a causal
kernel's loops are shorter for early query blocks), summed over the grid. Bytes are the
operands' and results' (the strategies charge them); the kernel keeps no intermediate in device
memory beyond its results.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from planner.core.compat import PallasGrid, pallas_grid
from planner.graph.ir import Graph, Literal, Op
from planner.ilp.opsig import Labels, OpSig, tensor_of

# How to say what the planner could not see in a kernel (one warning per kernel).
DECLARE = ("declare its parallel dimensions with planner.register_kernel(fn, in_axes=..., out_axes=...)")


def _replicated(op: Op, graph: Graph, why: str) -> OpSig:
    ins = tuple(None if isinstance(x, Literal) else (None,) * len(graph.tensors[x].shape) for x in op.inputs)
    outs = tuple((None,) * len(graph.tensors[t].shape) for t in op.outputs)
    return OpSig(ins, outs, {}, known=False, fallback=why)


# ----- Pallas -------------------------------------------------------------------------------------
def parallel_axes(facts: PallasGrid) -> tuple[tuple[int, ...], str]:
    """The grid axes along which the kernel is independent (module docstring), and why there are
    none when there are none ("" otherwise)."""
    read = _program_axes(facts.body)
    n_in = len(facts.blocks) - facts.num_outputs
    why: list[str] = []
    found = []
    for g, extent in enumerate(facts.grid):
        if extent <= 1:
            continue
        if facts.semantics is not None and g < len(facts.semantics) and "parallel" not in facts.semantics[g]:
            why.append(f"grid axis {g} is {facts.semantics[g]!r}")
            continue
        if g in read:
            why.append(f"the kernel reads the program id of grid axis {g}")
            continue
        ok = True
        for k, (shape, axes, blocks) in enumerate(facts.blocks):
            dims = [d for d, a in enumerate(axes) if a == g]
            if k >= n_in and len(dims) != 1:
                ok = False  # a result not split by this axis: programs along it share its blocks
                break
            if len(dims) > 1 or any(blocks[d] * extent != shape[d] for d in dims):
                ok = False
                break
        if ok:
            found.append(g)
        else:
            why.append(f"grid axis {g} does not tile each result")
    return tuple(found), "" if found else "; ".join(why) or "its grid has one program"


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

    ins: list[Labels | None] = []
    for k, x in enumerate(op.inputs):
        if isinstance(x, Literal):
            ins.append(None)
        elif k < facts.index_operands:
            ins.append((None,) * len(graph.tensors[x].shape))
        else:
            ins.append(labels(facts.blocks[k - facts.index_operands][1]))
    n_in = len(facts.blocks) - facts.num_outputs
    outs = tuple(labels(facts.blocks[n_in + j][1]) for j in range(len(op.outputs)))
    sizes = {f"g{a}": facts.grid[a] for a in axes}
    return OpSig(tuple(ins), outs, sizes, flops=float(flops))


def _sub_jaxprs(eqn) -> list:
    out = []
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def _program_axes(jaxpr) -> set[int]:
    """Grid axes whose program id or count the kernel body reads."""
    found: set[int] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("program_id", "num_programs"):
            found.add(int(eqn.params["axis"]))
        for sub in _sub_jaxprs(eqn):
            found |= _program_axes(sub)
    return found


# ----- FLOPs of a kernel body, per program ---------------------------------------------------------
_SCALAR_OPS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "neg": np.negative,
}


def _div(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):
        return np.trunc(a / np.where(b == 0, 1, b)).astype(np.int64)  # XLA's integer division rounds to zero
    return a / b


def _dot_flops(eqn) -> float:
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)


def kernel_flops(facts: PallasGrid) -> float:
    """The kernel's FLOPs summed over its grid (module docstring): matmuls only, each loop's body
    times its trip count where the body's scalar arithmetic gives it (once where it does not)."""
    grid = facts.grid
    per_program = _flops(facts.body, {}, grid)
    return float(np.broadcast_to(np.asarray(per_program, dtype=np.float64), grid).sum()) if grid else float(per_program)


def _value(env: Mapping[Any, Any], x) -> Any:
    if isinstance(x, jcore.Literal):
        return np.asarray(x.val)
    return env.get(x)


def _flops(jaxpr, env: dict, grid: tuple[int, ...]) -> Any:
    """FLOPs of one pass of `jaxpr` per program (an array over the grid, or a number); `env`:
    the scalar values known so far (per program)."""
    total: Any = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total = total + _dot_flops(eqn)
        elif name == "program_id":
            axis = int(eqn.params["axis"])
            shape = [1] * len(grid)
            shape[axis] = grid[axis]
            env[eqn.outvars[0]] = np.arange(grid[axis]).reshape(shape)
        elif name == "num_programs":
            env[eqn.outvars[0]] = np.asarray(grid[int(eqn.params["axis"])])
        elif name == "while":
            total = total + _while_flops(eqn, env, grid)
        elif name == "scan":
            total = total + eqn.params["length"] * _flops(eqn.params["jaxpr"].jaxpr, {}, grid)
        elif name == "cond":
            branches = [_flops(b.jaxpr, {}, grid) for b in eqn.params["branches"]]
            total = total + max(branches, key=lambda f: float(np.max(f)))
        elif _sub_jaxprs(eqn):  # a call (jit, closed_call): its operands as its inputs
            sub = _sub_jaxprs(eqn)[0]
            total = total + _flops(sub, {v: _value(env, x) for v, x in zip(sub.invars, eqn.invars)
                                         if _value(env, x) is not None}, grid)
        else:
            _scalar(eqn, env)
    return total


def _scalar(eqn, env: dict) -> None:
    """Evaluates a scalar integer / boolean op whose operands are known (per program)."""
    if len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != ():
        return
    vals = [_value(env, x) for x in eqn.invars]
    if any(v is None for v in vals):
        return
    name = eqn.primitive.name
    if name in _SCALAR_OPS:
        env[eqn.outvars[0]] = _SCALAR_OPS[name](*vals)
    elif name == "div":
        env[eqn.outvars[0]] = _div(*vals)
    elif name == "convert_element_type":
        env[eqn.outvars[0]] = np.asarray(vals[0]).astype(np.dtype(eqn.params["new_dtype"]))
    elif name == "select_n":
        env[eqn.outvars[0]] = np.choose(np.asarray(vals[0]).astype(np.int64), vals[1:])


def _while_flops(eqn, env: dict, grid: tuple[int, ...]) -> Any:
    """A `while` (a `fori_loop` with bounds known only per program): its body's FLOPs times its trip
    count, read from a predicate `i < n` over two carries or constants whose start values are
    known; once when the trip count cannot be read."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    body = _flops(p["body_jaxpr"].jaxpr, {}, grid)
    cond = p["cond_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return body
    operands = list(eqn.invars[:cn]) + list(eqn.invars[cn + bn:])  # the predicate's constants, then carries
    where = {v: operands[k] for k, v in enumerate(cond.invars)}
    lo, hi = (_value(env, where.get(x, x)) if not isinstance(x, jcore.Literal) else np.asarray(x.val)
              for x in cond.eqns[0].invars)
    if lo is None or hi is None:
        return body
    return np.maximum(np.asarray(hi) - np.asarray(lo), 0) * body


# ----- kernels declared by the user (`planner.register_kernel`: a `custom_partitioning` call) ------
def custom_partitioning_rule(op: Op, graph: Graph) -> OpSig:
    """Labels from the call's sharding rule (its factors, as `SdyShardingRule` states them): a
    factor in every result is a dimension the kernel is independent along; any other factor (a
    compound one, one the results lack) stays whole. FLOPs: what the declaration states
    (`register_kernel(flops=)`), else the matmuls of the call's body."""
    rule = op.params.get("sharding_rule")
    ops_map = getattr(rule, "operand_mappings", None)
    res_map = getattr(rule, "result_mappings", None)
    if ops_map is None or res_map is None:
        return _replicated(op, graph, f"custom_partitioning call without a sharding rule; {DECLARE}")
    in_results = set.intersection(*(set(f for f in m if isinstance(f, str)) for m in res_map)) if res_map else set()
    in_results -= set(getattr(rule, "need_replication_factors", ()))
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
    flops = declared if declared is not None else (_flops(body.jaxpr, {}, ()) if body is not None else 0.0)
    if not sizes:
        return _replicated(op, graph, f"the sharding rule of {getattr(op.params.get('partition'), 'name', 'a kernel')!r} "
                                      "names no dimension in every result; " + DECLARE)
    return OpSig(ins, outs, sizes, flops=float(flops))


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


KERNEL_RULES = {
    "pallas_call": pallas_call_rule,
    "custom_partitioning": custom_partitioning_rule,
    "ragged_dot_general": ragged_dot_rule,
}
