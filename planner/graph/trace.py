"""Tracing a train step into the planner's graph: a flat list of primitive ops over typed tensors.

Nested `jit`, `custom_jvp_call`, `custom_vjp_call` and `checkpoint` regions are inlined so the
planner sees every primitive; each op keeps the name stack of the module that created it, and each
input keeps its pytree path, so plans can be explained per layer and per parameter. A custom
derivative's body is also kept as a region, so that evaluation binds it again with its own rule:
a program that differentiates the re-evaluated graph (the pipeline's stage programs) gets the
user's derivative, not the derivative of the inlined primal (`relu`'s is 0 at 0, `max`'s is 1/2).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy  # noqa: F401  (jax.numpy.stack in unroll_scan)
import numpy as np
from jax.extend import core as jcore

from planner.core.compat import JIT_BOUNDARY, bind, rebind, scan_counts
from planner.core.errors import InvalidArgumentError
from planner.core.layer_index import COND_BRANCH, SCAN_ITERATION
from planner.core.static_args import is_array

Shape = tuple[int, ...]

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


@dataclasses.dataclass(frozen=True, slots=True)
class Tensor:
    """Type of one value in the graph."""

    shape: Shape
    dtype: Any  # a numpy dtype, or a JAX extended dtype such as key<fry> (has .itemsize)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class Literal:
    """A constant operand written inline in the program (usually a scalar)."""

    value: Any
    tensor: Tensor


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Op:
    """One primitive application. `inputs` holds tensor ids or `Literal`s; `outputs` tensor ids."""

    index: int
    primitive: jcore.Primitive
    params: Mapping[str, Any]
    inputs: tuple[int | Literal, ...]
    outputs: tuple[int, ...]
    name_stack: str
    tensor_inputs: tuple[int, ...] = dataclasses.field(init=False, repr=False)  # the non-literal inputs

    def __post_init__(self):
        object.__setattr__(self, "tensor_inputs", tuple(i for i in self.inputs if isinstance(i, int)))

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclasses.dataclass(frozen=True, slots=True)
class Body:
    """One body of a control-flow op as planned: ops [start, end) computing `outputs` from `inputs`
    (graph tensors bound to the body jaxpr's inputs and outputs)."""

    start: int
    end: int
    inputs: tuple[int | Literal, ...]
    outputs: tuple[int | Literal, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Region:
    """A control-flow op (scan, cond, while) whose bodies were inlined for planning.

    Ops [start, end) are its planning expansion; evaluation runs the original control flow
    instead (`lax.scan` / `lax.switch` / `lax.while_loop`) over the planned bodies, so the emitted
    program keeps its loops and branches while every op inside carries its planned sharding.

    Attributes:
      kind: "scan", "cond", "while", or the custom-derivative call's primitive name
        ("custom_jvp_call", "custom_vjp_call": bound again with its rule, see `CUSTOM_CALLS`).
      params: the original op's parameters.
      operands: the original op's operands.
      outputs: graph tensors that hold the op's results.
      bodies: scan: the first emitted iteration; cond: one per branch; while: the loop body;
        custom call: its body.
      primitive: the original op's primitive (bound again for custom calls and batched whiles).
      name_stack: the original op's name stack (the scope its rule's ops are made in).
    """

    kind: str
    start: int
    end: int
    params: Mapping[str, Any]
    operands: tuple[int | Literal, ...]
    outputs: tuple[int | Literal, ...]
    bodies: tuple[Body, ...]
    primitive: Any = None
    name_stack: str = ""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Recompute:
    """Ops [start, end) recompute forward values for the backward pass (`planner.levers.remat`).

    Evaluation passes `inputs` together with `gate` (a value that exists only once the backward
    pass reaches these ops, e.g. the incoming cotangent) through one `jax.lax.optimization_barrier`,
    makes the computed ones among them depend on `gate` (`_after`) and runs the ops on those, so XLA
    neither merges them back into the forward ops they copy (CSE) nor computes them before the
    backward needs them.
    """

    start: int
    end: int
    inputs: tuple[int, ...]
    gate: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Graph:
    """The traced program.

    Attributes:
      tensors: type of each tensor id.
      ops: the primitive ops in program order.
      inputs: tensor ids of the flattened arguments, in `jax.tree_util` order.
      input_paths: pytree path (`jax.tree_util.keystr`) of each input, e.g. `[0]['params']['w']`.
      outputs: tensor ids (or literals) of the flattened results.
      output_paths: pytree path of each output.
      consts: constant tensors captured by the program (id -> value).
      in_tree / out_tree: treedefs of the arguments tuple and of the result.
      regions: control-flow ops by the index of their first planning op, largest first (see `Region`).
      loop_ties: (carry in, carry out) tensor pairs of while loops: one sharding for both.
      user_constraints: "pin" (the user's sharding constraints fix their results' sharding) or
        "hint" (the planner may choose another); read by the constraint's rule.
      recompute: recomputation groups by the index of their first op (see `Recompute`).
      update_groups: [start, end) op ranges of a streamed optimizer update, one per group of
        optimizer-state leaves updated together (`planner.ilp.offload.streamed`); empty otherwise.
    """

    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    input_paths: tuple[str, ...]
    outputs: tuple[int | Literal, ...]
    output_paths: tuple[str, ...]
    consts: Mapping[int, Any]
    in_tree: Any
    out_tree: Any
    regions: Mapping[int, tuple[Region, ...]] = dataclasses.field(default_factory=dict)
    loop_ties: tuple[tuple[int, int], ...] = ()
    user_constraints: str = "pin"
    recompute: Mapping[int, Recompute] = dataclasses.field(default_factory=dict)
    update_groups: tuple[tuple[int, int], ...] = ()  # streamed optimizer update: op ranges (`offload.streamed`)
    # Facts computed from the graph alone, kept for the next ILP of the same graph (`cached`); a graph
    # made by `dataclasses.replace` starts with an empty one.
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per graph and `key`: for facts that depend on the graph alone
        (its ops' sharding-rule signatures, its fusions), which every mesh's ILP of one planning
        run asks for again (GPT-39B: 2.3 of the 4.7 s an ILP build takes). The value is shared:
        treat it as read-only."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def producers(self) -> dict[int, tuple[int, int]]:
        """tensor id -> (op index, output position)."""
        return {t: (op.index, k) for op in self.ops for k, t in enumerate(op.outputs)}

    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """tensor id -> [(op index, operand position)]."""
        out: dict[int, list[tuple[int, int]]] = {}
        for op in self.ops:
            for k, t in enumerate(op.inputs):
                if isinstance(t, int):
                    out.setdefault(t, []).append((op.index, k))
        return out

    def evaluate(
        self,
        flat_args: Sequence[Any],
        after_op: Callable[[Op, list[Any]], list[Any]] | None = None,
        before_op: Callable[[Op, list[Any]], list[Any]] | None = None,
    ) -> list[Any]:
        """Re-interprets the graph on `flat_args` (inside or outside `jax.jit`).

        `before_op(op, operands)` and `after_op(op, outputs)` may replace each op's operands and
        outputs, which is how planned sharding constraints are inserted.
        """
        env: dict[int, Any] = dict(self.consts)
        if len(flat_args) != len(self.inputs):
            raise InvalidArgumentError(f"expected {len(self.inputs)} flat arguments, got {len(flat_args)}")
        env.update(zip(self.inputs, flat_args))

        self._run(0, len(self.ops), env, (before_op, after_op, None), ())
        return [_read(env, x) for x in self.outputs]

    def run_range(self, start: int, end: int, env: dict[int, Any], before_op=None, after_op=None,
                  scope=None) -> None:
        """Runs ops [start, end) on `env` (tensor id -> value, updated in place) as `evaluate` does:
        a region wholly inside the range runs as its control flow (or custom call), one crossing its
        ends op by op. `scope(region)`, when given, is the context manager a custom call is bound
        in (the ops its derivative rule makes take that scope's name)."""
        self._run(start, end, env, (before_op, after_op, scope), ())

    def _run(self, start: int, end: int, env: dict[int, Any], hooks: tuple, active: tuple) -> None:
        before_op, after_op, _ = hooks
        i = start
        while i < end:
            # The largest region starting here that fits the range being run and is not already
            # running (a body may start, or even end, where its own region does; regions nest).
            region = next((r for r in self.regions.get(i, ()) if r.end <= end and not any(r is a for a in active)),
                          None)
            if region is not None:
                outs = self._run_region(region, env, hooks, active + (region,))
                env.update((t, v) for t, v in zip(region.outputs, outs) if isinstance(t, int))
                i = region.end
                continue
            group = self.recompute.get(i)
            if group is not None and group.end <= end and not any(group is a for a in active):
                vals = jax.lax.optimization_barrier([env[t] for t in group.inputs] + [env[group.gate]])
                local = dict(env)
                args = set(self.inputs)
                local.update(zip(group.inputs, _after(vals[:-1], vals[-1], [t in args for t in group.inputs])))
                self._run(i, group.end, local, hooks, active + (group,))
                env.update((t, local[t]) for op in self.ops[i:group.end] for t in op.outputs)
                i = group.end
                continue
            op = self.ops[i]
            operands = [_read(env, x) for x in op.inputs]
            if before_op is not None:
                operands = before_op(op, operands)
            result = bind(op.primitive, op.params, operands)
            outs = list(result) if op.primitive.multiple_results else [result]
            if after_op is not None:
                outs = after_op(op, outs)
            env.update(zip(op.outputs, outs))
            i += 1

    def _body_fn(self, body: Body, env: dict[int, Any], hooks: tuple, active) -> Callable[..., list[Any]]:
        def fn(*args):
            local = dict(env)
            local.update((t, v) for t, v in zip(body.inputs, args) if isinstance(t, int))
            self._run(body.start, body.end, local, hooks, active)
            return [_read(local, x) for x in body.outputs]

        return fn

    def _pin_results(self, region: Region, outs: Sequence[Any], after_op) -> list[Any]:
        """`outs` (the region's results) placed where the plan decided them: each through `after_op`
        of the op that makes it in the planning expansion (a cond's select, a scan's stack)."""
        if after_op is None:
            return list(outs)
        producers = {t: op for op in self.ops[region.start:region.end] for t in op.outputs}
        return [after_op(producers[t], [v])[0] if isinstance(t, int) and t in producers
                and len(producers[t].outputs) == 1 else v for t, v in zip(region.outputs, outs)]

    def _run_region(self, region: Region, env: dict[int, Any], hooks: tuple, active) -> list[Any]:
        p = region.params
        vals = [_read(env, x) for x in region.operands]
        if region.kind == "scan":
            nc, nk = scan_counts(p)
            body = self._body_fn(region.bodies[0], env, hooks, active)

            def step(carry, x):
                out = body(*vals[:nc], *carry, *x)
                return out[:nk], out[nk:]

            carry, ys = jax.lax.scan(step, vals[nc:nc + nk], vals[nc + nk:], length=p["length"], reverse=p["reverse"])
            outs = list(carry) + list(ys)
        elif region.kind == "cond":
            # XLA requires every branch of a conditional to return its results in one sharding: the
            # cond's planned one, applied inside each branch
            branches = [lambda *a, f=self._body_fn(b, env, hooks, active): self._pin_results(region, f(*a), hooks[1])
                        for b in region.bodies]
            outs = list(jax.lax.switch(vals[0], branches, *vals[1:]))
        elif region.kind == "while":
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            test = jcore.jaxpr_as_fun(p["cond_jaxpr"])
            if p["cond_jaxpr"].out_avals[0].shape:  # a batched predicate (vmap): the equation itself
                # (the body jaxpr reads only its operands: the loop's constants and carries)
                body = self._body_fn(region.bodies[0], dict(self.consts), hooks, active)
                outs = list(rebind(region.primitive, p, {"body_jaxpr": body}, vals))
            else:
                body = self._body_fn(region.bodies[0], env, hooks, active)
                outs = list(jax.lax.while_loop(lambda c: test(*vals[:cn], *c)[0],
                                               lambda c: tuple(body(*vals[cn:cn + bn], *c)), tuple(vals[cn + bn:])))
        else:  # a custom-derivative call: its body (a closed jaxpr: it reads only its operands and consts)
            body = self._body_fn(region.bodies[0], dict(self.consts), hooks, active)
            scope = hooks[2](region) if hooks[2] is not None else contextlib.nullcontext()
            with scope:
                outs = list(rebind(region.primitive, p, {"call_jaxpr": body}, vals))
        if region.kind == "while":  # its carries keep their tied layout
            return outs
        return self._pin_results(region, outs, hooks[1])


def _after(values: Sequence[Any], gate: Any, skip: Sequence[bool]) -> list[Any]:
    """`values` made data-dependent on `gate`: x - 0 * gate[0, ..., 0], which is x when that element
    is finite (except that a -0 in x becomes +0 when that element is negative or -0; an inf or
    nan there, a non-finite gradient already, turns the recomputed values into nan).
    XLA removes optimization barriers before it schedules (OptimizationBarrierExpander), and XLA:CPU's
    default scheduler then computed the recomputation during the forward (measured: no saving); an
    operand keeps it after `gate`. Cost: one element of `gate` (a 4-byte all-reduce when `gate` is
    sharded). Program arguments (`skip`) and non-float values pass as they are."""
    floating = getattr(gate, "size", 0) and jax.numpy.issubdtype(gate.dtype, jax.numpy.floating)
    g = gate[(0,) * gate.ndim] if floating else None
    out = []
    for v, s in zip(values, skip):
        dtype = getattr(v, "dtype", None)
        floating = dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating)
        out.append(v if s or g is None or not floating else v - (g * 0).astype(dtype))
    return out


def _read(env: dict[int, Any], x: int | Literal) -> Any:
    return x.value if isinstance(x, Literal) else env[x]


def _tensor_of(aval) -> Tensor:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        raise InvalidArgumentError(f"value of type {aval} is not an array; the planner only handles array values")
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) are kept as they are
        pass
    return Tensor(tuple(int(d) for d in shape), dtype)


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

    def new(self, aval) -> int:
        self.tensors.append(_tensor_of(aval))
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
                return Literal(x.val, _tensor_of(x.aval))
            return env[x]

        for eqn in jaxpr.eqns:
            operands = [read(x) for x in eqn.invars]
            stack = str(eqn.source_info.name_stack)
            full = "/".join(p for p in (prefix, stack) if p)
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
    # An output that is itself a literal or a const is still an output; keep its id or literal.
    return Graph(
        tensors=tuple(b.tensors),
        ops=tuple(b.ops),
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
    )


def matmul_flops(graph: Graph) -> dict[str, float]:
    """Matmul FLOPs per step by operand dtype: 2 x output size x contracted size of every dot_general
    (what model FLOP utilisation counts)."""
    out: dict[str, float] = {}
    for op in graph.ops:
        if op.name != "dot_general":
            continue
        (lhs_contract, _), _ = op.params["dimension_numbers"]
        lhs = graph.tensors[op.inputs[0]] if isinstance(op.inputs[0], int) else op.inputs[0].tensor
        res = graph.tensors[op.outputs[0]]
        key = str(lhs.dtype)
        out[key] = out.get(key, 0.0) + 2.0 * res.size * math.prod(lhs.shape[d] for d in lhs_contract)
    return out
