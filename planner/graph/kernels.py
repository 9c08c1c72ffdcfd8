"""What a fused kernel's program says about it: the grid axes of a Pallas call along which it is
independent, and its FLOPs (see `planner.ilp.kernel_rules` for how the planner uses them).

A grid axis whose program id is, one to one, the block index of one dimension of every result
(and of whichever operands it indexes), whose blocks tile those dimensions exactly, which the
kernel body never reads (`program_id` / `num_programs`: a causal mask's offset would be wrong on
a shard) and which the compiler parameters do not call "arbitrary", is a dimension along which the
kernel is independent. FLOPs: the matmuls of the body per program, loops by their trip counts
(evaluated for every program id: a causal kernel's loops are shorter for early query blocks),
summed over the grid.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.extend import core as jcore

from planner.core.compat import PallasGrid
from planner.graph.ir import Graph, Literal, Op

log = logging.getLogger("planner")


def parallel_axes(facts: PallasGrid) -> tuple[tuple[int, ...], str]:
    """The grid axes along which the kernel is independent (module docstring), and why there are
    none when there are none ("" otherwise)."""
    read = _program_axes(facts.body)
    n_in = len(facts.blocks) - facts.num_outputs
    why: list[str] = []
    found = []
    for g, extent in enumerate(facts.grid):
        if extent is None or extent <= 1:
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
    if any(g is None for g in facts.grid):  # an axis sized at run time: its programs counted once
        log.warning("kernel %r: grid axes sized at run time; its FLOPs are counted for one program along them "
                    "(give the kernel a cost_estimate)", facts.name)
    grid = tuple(g or 1 for g in facts.grid)
    per_program = _flops(facts.body, {}, grid)
    return float(np.broadcast_to(np.asarray(per_program, dtype=np.float64), grid).sum()) if grid else float(per_program)


def matmul_dtypes(jaxpr) -> tuple[str, ...]:
    """The dtypes of every matmul operand in `jaxpr` and the jaxprs inside it: what sets a fused
    kernel's FLOP rate (a bf16 x bf16 matmul runs on the tensor cores whatever float32 statistics
    the kernel also reads)."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.update(str(v.aval.dtype) for v in eqn.invars[:2])
        for sub in _sub_jaxprs(eqn):
            found.update(matmul_dtypes(sub))
    return tuple(sorted(found))


def jaxpr_flops(jaxpr) -> float:
    """The matmul FLOPs of one run of `jaxpr` (a kernel declared by the user: its function's jaxpr)."""
    return float(_flops(jaxpr, {}, ()))


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


# ----- a `custom_partitioning` call's sharding rule -------------------------------------------------
def _tensor(graph: Graph, x):
    return x.tensor if isinstance(x, Literal) else graph.tensors[x]


def sharding_rule_factors(op: Op, graph: Graph):
    """(operand factor tuples, result factor tuples, factors that need replication) of a
    `custom_partitioning` call's Shardy rule, one factor per dimension: a `SdyShardingRule`, an
    einsum-like string ("b s, b s -> b s"; "..." and compound factors keep their dimensions whole),
    or a function of the static arguments and the operand and result types giving one (as jax's
    cuDNN attention states its rule); why not, as a string, where it cannot be read so."""
    rule = op.params.get("sharding_rule")
    if callable(rule) and not isinstance(rule, str):
        ins = [_tensor(graph, x) for x in op.inputs]
        try:
            rule = rule(*op.params.get("static_args", ()), None, ins, [graph.tensors[t] for t in op.outputs])
        except Exception as e:  # the rule is the user's code: any failure means "cannot read it"
            return f"its sharding rule function failed outside lowering ({type(e).__name__})"
    if isinstance(rule, str):
        if "->" not in rule:
            return "its sharding rule has no '->'"
        lhs, rhs = rule.split("->", 1)
        def parse(side):
            return [tuple(f if f.isidentifier() else None for f in part.split()) for part in side.split(",")]
        ops_map, res_map, whole = parse(lhs), parse(rhs), ()
    else:
        ops_map = getattr(rule, "operand_mappings", None)
        res_map = getattr(rule, "result_mappings", None)
        whole = tuple(getattr(rule, "need_replication_factors", ()))
        if ops_map is None or res_map is None:
            return "it states no sharding rule"
    ranks = [len(_tensor(graph, x).shape) for x in op.inputs] + [len(graph.tensors[t].shape) for t in op.outputs]
    if len(ops_map) != len(op.inputs) or len(res_map) != len(op.outputs) or any(
            len(m) != r for m, r in zip(list(ops_map) + list(res_map), ranks)):
        return "its sharding rule does not name one factor per dimension of every operand and result"
    return tuple(tuple(m) for m in ops_map), tuple(tuple(m) for m in res_map), whole
