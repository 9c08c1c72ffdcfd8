"""Tracing a train step into the planner's graph: a flat list of primitive ops over typed tensors.

Nested `jit`, `custom_jvp_call`, `custom_vjp_call` and `checkpoint` regions are inlined so the
planner sees every primitive; each op keeps the name stack of the module that created it, and each
input keeps its pytree path, so plans can be explained per layer and per parameter. A custom
derivative's body is also kept as a region, so that evaluation binds it again with its own rule:
a program that differentiates the re-evaluated graph (the pipeline's stage programs) gets the
user's derivative, not the derivative of the inlined primal (`relu`'s is 0 at 0, `max`'s is 1/2).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy  # noqa: F401  (jax.numpy.stack in unroll_scan)
import numpy as np
from jax.extend import core as jcore

from planner.core.compat import PLANNER_CONSTRAINT as JIT_BOUNDARY, called_from, scan_counts
from planner.core.errors import InvalidArgumentError
from planner.core.layer_index import COND_BRANCH, SCAN_ITERATION, in_fused_attention, with_fused_attention
from planner.core.static_args import is_array
from planner.graph.ir import Body, Graph, Literal, Op, Region, Tensor, Traced, tensor_of

# The records are `planner.graph.ir`'s; importers name them from here too.
__all__ = ["ATTENTION_CORE", "CUSTOM_CALLS", "MAX_UNROLL", "trace"]

# The function of `jax.nn.dot_product_attention`'s XLA implementation that computes the attention
# itself (jax/_src/nn/functions.py): its ops are named `.../fused_attention` (`_Builder.inline`).
ATTENTION_CORE = "_dot_product_attention_core"

# Scans up to this many iterations are unrolled for planning (see `_Builder.unroll_scan`).
MAX_UNROLL = 512

# Custom-derivative calls: inlined for planning, bound again with their rule for evaluation.
CUSTOM_CALLS = frozenset({"custom_jvp_call", "custom_vjp_call"})

# Call-like primitives whose body is inlined, with the parameter that holds the body.
_INLINE_PARAMS: Mapping[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
    "custom_lin": (),
}


def _check_leaves(args: tuple[Any, ...]) -> tuple[list[str], list[Any]]:
    with_path, _ = jax.tree_util.tree_flatten_with_path(args)
    paths, leaves = [], []
    for path, leaf in with_path:
        p = jax.tree_util.keystr(path)
        if not is_array(leaf):
            raise InvalidArgumentError(
                f"argument leaf at {p} is {type(leaf).__name__} ({leaf!r:.60}), not an array; pass arrays or "
                "jax.ShapeDtypeStruct leaves, and close over Python values instead of passing them"
            )
        paths.append(p)
        leaves.append(leaf)
    return paths, leaves


def _symbolic_scalar(eqn, operands: Sequence[int | Literal]) -> bool:
    """Whether `eqn` makes a scalar from a symbolic dimension: `dim_as_value` (a shape's size used
    as a value, e.g. the count a mean divides by), or a conversion of one. Traced on concrete shapes
    the same value is a literal; kept as one here, `shape_family` gives it its value per size."""
    if eqn.primitive.name == "dim_as_value":
        return True
    return (eqn.primitive.name == "convert_element_type" and len(operands) == 1
            and isinstance(operands[0], Literal) and jax.export.is_symbolic_dim(operands[0].value))


def _inner_jaxpr(eqn) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
    for key in _INLINE_PARAMS.get(eqn.primitive.name, ()):
        inner = eqn.params.get(key)
        if inner is None:
            continue
        if isinstance(inner, jcore.ClosedJaxpr):
            return inner.jaxpr, inner.consts
        if isinstance(inner, jcore.Jaxpr):
            return inner, ()
    return None


@dataclasses.dataclass(slots=True)
class _Builder:
    """Accumulates tensors and ops while flattening nested jaxprs (local to one `trace` call)."""

    tensors: list[Tensor] = dataclasses.field(default_factory=list)
    ops: list[Op] = dataclasses.field(default_factory=list)
    consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    regions: dict[int, list[Region]] = dataclasses.field(default_factory=dict)
    loop_ties: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    attention: dict[int, bool] = dataclasses.field(default_factory=dict)  # id(eqn) -> in the attention core

    def in_attention(self, eqn) -> bool:
        """Whether `eqn` computes `jax.nn.dot_product_attention`'s core (its source traceback; looked
        up once per equation: an unrolled scan inlines its body's equations once per iteration)."""
        key = id(eqn)
        if key not in self.attention:
            self.attention[key] = called_from(eqn, ATTENTION_CORE)
        return self.attention[key]

    def new(self, aval) -> int:
        self.tensors.append(tensor_of(aval))
        return len(self.tensors) - 1

    def add_const(self, value) -> int:
        tid = self.new(value)
        self.consts[tid] = value
        return tid

    def inline(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[int | Literal], prefix: str):
        env: dict[Any, int | Literal] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.add_const(c)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a

        def read(x) -> int | Literal:
            if isinstance(x, jcore.Literal):
                return Literal(x.val, tensor_of(x.aval))
            return env[x]

        for eqn in jaxpr.eqns:
            operands = [read(x) for x in eqn.invars]
            if _symbolic_scalar(eqn, operands):  # a size of a symbolic shape as a value: a literal
                env[eqn.outvars[0]] = Literal(eqn.params["dim"] if operands == [] else operands[0].value,
                                              tensor_of(eqn.outvars[0].aval))
                continue
            stack = str(eqn.source_info.name_stack)
            full = "/".join(p for p in (prefix, stack) if p)
            if not in_fused_attention(full) and self.in_attention(eqn):
                full = with_fused_attention(full)
            expand = {"scan": self.unroll_scan, "cond": self.inline_cond, "while": self.inline_while}.get(
                eqn.primitive.name)
            if expand is not None and (eqn.primitive.name != "scan" or 0 < eqn.params["length"] <= MAX_UNROLL):
                start = len(self.ops)
                results, bodies = expand(eqn, operands, full)
                if len(self.ops) > start:
                    self.regions.setdefault(start, []).append(Region(
                        eqn.primitive.name, start, len(self.ops), dict(eqn.params), tuple(operands), tuple(results),
                        tuple(bodies), eqn.primitive, full))
                for v, r in zip(eqn.outvars, results):
                    env[v] = r
                continue
            inner = _inner_jaxpr(eqn)
            if inner is not None and eqn.primitive.name in CUSTOM_CALLS and "call_jaxpr" in eqn.params:
                results = self.inline_custom(eqn, inner, operands, full)
                for v, r in zip(eqn.outvars, results):
                    env[v] = r
                continue
            if inner is not None:
                sub_prefix = full
                call_name = eqn.params.get("name")
                if isinstance(call_name, str) and eqn.primitive.name in ("jit", "pjit", "custom_jvp_call"):
                    sub_prefix = "/".join(p for p in (full, call_name) if p)
                if eqn.primitive.name in ("jit", "pjit"):  # the user's in/out shardings pin the boundary
                    operands = [self.pin(x, sh, sub_prefix) for x, sh in
                                zip(operands, eqn.params.get("in_shardings", ()) or [None] * len(operands))]
                results = self.inline(inner[0], inner[1], operands, sub_prefix)
                if eqn.primitive.name in ("jit", "pjit"):
                    results = [self.pin(x, sh, sub_prefix) for x, sh in
                               zip(results, eqn.params.get("out_shardings", ()) or [None] * len(results))]
                for v, r in zip(eqn.outvars, results):
                    env[v] = r
                continue
            outs = tuple(self.new(v.aval) for v in eqn.outvars)
            for v, t in zip(eqn.outvars, outs):
                env[v] = t
            self.ops.append(Op(len(self.ops), eqn.primitive, dict(eqn.params), tuple(operands), outs, full))
        return [read(v) for v in jaxpr.outvars]

    def pin(self, x: int | Literal, sharding, prefix: str) -> int | Literal:
        """`x` through a constraint op holding `sharding` when that is a `NamedSharding` (a nested
        jit's stated in/out sharding), planned as the user's own `with_sharding_constraint`."""
        if not isinstance(sharding, jax.sharding.NamedSharding) or isinstance(x, Literal):
            return x
        out = self.new(self.tensors[x])
        self.ops.append(Op(len(self.ops), JIT_BOUNDARY, {"sharding": sharding}, (x,), (out,), prefix))
        return out

    def materialize(self, xs: Sequence[int | Literal]) -> list[int]:
        """Literal loop carries as constant tensors: a loop body rebinds its carries every
        iteration, which a literal written into the body cannot be."""
        out = []
        for x in xs:
            if isinstance(x, Literal):
                self.tensors.append(x.tensor)
                self.consts[len(self.tensors) - 1] = x.value
                x = len(self.tensors) - 1
            out.append(x)
        return out

    def _aval(self, x: int | Literal):
        t = x.tensor if isinstance(x, Literal) else self.tensors[x]
        return jax.ShapeDtypeStruct(t.shape, t.dtype)

    def call(self, fn: Callable[..., Any], args: Sequence[int | Literal], prefix: str) -> list[int | Literal]:
        """Inlines the primitives of `fn` (traced on the types of `args`) applied to `args`."""
        closed = jax.make_jaxpr(fn)(*(self._aval(a) for a in args))
        return self.inline(closed.jaxpr, closed.consts, list(args), prefix)

    def unroll_scan(self, eqn, operands: list[int | Literal], prefix: str) -> list[int | Literal]:
        """A `scan` as its iterations: index each stacked input, inline the body, stack the outputs.

        Iteration `i` runs under the name `scaniter_<i>`, so the planner's layer sharing gives
        every iteration the same decisions: the body is planned once, carries keep one sharding
        across iterations and stacked weights are split on their non-layer dims only.
        """
        p = eqn.params
        length, (nc, nk) = p["length"], scan_counts(p)
        body = p["jaxpr"]
        consts, carry, xs = operands[:nc], self.materialize(operands[nc:nc + nk]), operands[nc + nk:]
        ys: dict[int, list[int | Literal]] = {}
        template: Body | None = None
        for i in (range(length - 1, -1, -1) if p["reverse"] else range(length)):
            x_i = [self.call(lambda a, i=i: jax.lax.index_in_dim(a, i, keepdims=False), [x], prefix)[0] for x in xs]
            start = len(self.ops)
            inputs = list(consts) + list(carry) + x_i
            out = self.inline(body.jaxpr, body.consts, inputs, f"{prefix}/{SCAN_ITERATION}_{i}")
            if template is None:
                template = Body(start, len(self.ops), tuple(inputs), tuple(out))
            carry, ys[i] = out[:nk], out[nk:]
        stacked = []
        for j in range(len(eqn.outvars) - nk):
            parts = [ys[i][j] for i in range(length)]
            stacked.append(self.call(lambda *a: jax.numpy.stack(a), parts, prefix)[0])
        return list(carry) + stacked, [template]

    def inline_custom(self, eqn, inner, operands: list[int | Literal], prefix: str) -> list[int | Literal]:
        """A custom-derivative call inlined as a region (see `Region`). Each result is made by an op
        of the region (an operand, a constant or a repeated result passes through a `copy`), so
        that a call whose primal is the identity (gradient clipping, gradient reversal) still has
        results of its own that evaluation binds to the call."""
        sub_prefix = "/".join(p for p in (prefix, eqn.params.get("name")) if isinstance(p, str) and p)
        start = len(self.ops)
        results = self.inline(inner[0], inner[1], operands, sub_prefix)
        made: set[int] = {t for op in self.ops[start:] for t in op.outputs}
        out: list[int | Literal] = []
        for r in results:
            if isinstance(r, Literal) or r not in made or r in out:
                r = self.call(jax.lax.copy_p.bind, [r], sub_prefix)[0]
                made.add(r)
            out.append(r)
        if len(self.ops) > start:
            self.regions.setdefault(start, []).append(Region(
                eqn.primitive.name, start, len(self.ops), dict(eqn.params), tuple(operands), tuple(out),
                (Body(start, len(self.ops), tuple(operands), tuple(out)),), eqn.primitive, prefix))
        return out

    def inline_cond(self, eqn, operands: list[int | Literal], prefix: str):
        """A `cond`/`switch` as all its branches plus a select of their results: planning sees every
        branch's ops, and the select makes each result's sharding the same in every branch."""
        index, args = operands[0], operands[1:]
        bodies, outs = [], []
        for k, branch in enumerate(eqn.params["branches"]):
            start = len(self.ops)
            out = self.inline(branch.jaxpr, branch.consts, list(args), f"{prefix}/{COND_BRANCH}_{k}")
            bodies.append(Body(start, len(self.ops), tuple(args), tuple(out)))
            outs.append(out)
        results = [self.call(lambda i, *v: jax.lax.select_n(i, *v), [index] + [o[j] for o in outs], prefix)[0]
                   for j in range(len(eqn.outvars))]
        return results, bodies

    def inline_while(self, eqn, operands: list[int | Literal], prefix: str):
        """A `while_loop` as one pass of its body, whose carry keeps one sharding (loop_ties)."""
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        consts, init = operands[cn:cn + bn], self.materialize(operands[cn + bn:])
        start = len(self.ops)
        out = self.inline(p["body_jaxpr"].jaxpr, p["body_jaxpr"].consts, list(consts) + list(init),
                          f"{prefix}/while_body")
        self.loop_ties.extend((a, b) for a, b in zip(init, out) if isinstance(a, int) and isinstance(b, int)
                              and a != b)
        return out, [Body(start, len(self.ops), tuple(consts) + tuple(init), tuple(out))]


def trace(fn: Callable[..., Any], *args: Any, user_constraints: str = "pin") -> Graph:
    """Traces `fn(*args)` into a `Graph`.

    Args:
      fn: the train step (any JAX-traceable function of array pytrees).
      *args: example arguments: arrays or `jax.ShapeDtypeStruct` pytrees (no allocation needed).
      user_constraints: "pin" or "hint": how the step's own sharding constraints are planned.

    Returns:
      The flattened graph, with nested calls and remat regions inlined.
    """
    paths, leaves = _check_leaves(args)
    abstract = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    _, in_tree = jax.tree_util.tree_flatten(args)
    abstract_args = jax.tree_util.tree_unflatten(in_tree, abstract)
    closed, out_shapes = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
    out_with_path, out_tree = jax.tree_util.tree_flatten_with_path(out_shapes)

    b = _Builder()
    input_ids = [b.new(v.aval) for v in closed.jaxpr.invars]
    outputs = b.inline(closed.jaxpr, closed.consts, input_ids, "")
    ops = tuple(b.ops)
    # An output that is itself a literal or a const is still an output; keep its id or literal.
    return Graph(
        tensors=tuple(b.tensors),
        ops=ops,
        inputs=tuple(input_ids),
        input_paths=tuple(paths),
        outputs=tuple(outputs),
        output_paths=tuple(jax.tree_util.keystr(p) for p, _ in out_with_path),
        consts=dict(b.consts),
        in_tree=in_tree,
        out_tree=out_tree,
        regions={k: tuple(sorted(v, key=lambda r: -r.end)) for k, v in b.regions.items()},
        loop_ties=tuple(b.loop_ties),
        user_constraints=user_constraints,
        source=Traced(closed, ops),
    )
