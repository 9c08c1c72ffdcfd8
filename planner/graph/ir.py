"""The planner's program: typed tensors and primitive ops (`Graph`), and the interpreter that runs it.

`planner.graph.trace` makes a `Graph` from a train step; `Graph.evaluate` / `Graph.run_range` run it
again, op by op, with the control flow (`Region`) and recomputation (`Recompute`) it recorded, and
hooks that place each op's operands and results (how planned shardings are inserted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy  # noqa: F401  (jax.numpy.issubdtype in _after)
import numpy as np
from jax.extend import core as jcore

from planner.core.compat import bind, rebind, scan_counts
from planner.core.errors import InvalidArgumentError

Shape = tuple[int, ...]


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
        ("custom_jvp_call", "custom_vjp_call": bound again with its rule, see `trace.CUSTOM_CALLS`).
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
class Traced:
    """The jaxpr a graph was traced from, with the ops tracing made of it: a graph whose ops are no
    longer these was transformed since, and its jaxpr no longer describes it
    (`planner.graph.scan_remat` rewrites the jaxpr of an untransformed graph only).

    Attributes:
      jaxpr: the step's `ClosedJaxpr`.
      ops: the traced graph's ops (compared by identity).
      scans_recomputed: scan pairs whose backward recomputes its residuals (`scan_remat`): 0 for
        the step as the user wrote it.
      scan_first: the layers of each such stack that recompute, its first ones (None: all).
    """

    jaxpr: Any
    ops: tuple
    scans_recomputed: int = 0
    scan_first: int | None = None


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
      source: the jaxpr it was traced from (`Traced`), or None.
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
    update_groups: tuple[tuple[int, int], ...] = ()  # streamed optimizer update: op ranges (`ilp.offload.streamed`)
    source: Traced | None = None
    # Facts computed from the graph alone, kept for the next ILP of the same graph (`cached`); a graph
    # made by `dataclasses.replace` starts with an empty one.
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per graph and `key`: for facts that depend on the graph alone
        (its ops' sharding-rule signatures, its fusions), which every mesh's ILP of one planning
        run asks for again. The value is shared: treat it as read-only."""
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
        apply_op: Callable[[Op, list[Any]], list[Any] | None] | None = None,
    ) -> list[Any]:
        """Re-interprets the graph on `flat_args` (inside or outside `jax.jit`).

        `before_op(op, operands)` and `after_op(op, outputs)` may replace each op's operands and
        outputs, which is how planned sharding constraints are inserted; `apply_op(op, operands)`
        may run an op itself (its results, or None to bind it as traced: how a fused kernel runs
        on its shards, `emit.kernels`).
        """
        env: dict[int, Any] = dict(self.consts)
        if len(flat_args) != len(self.inputs):
            raise InvalidArgumentError(f"expected {len(self.inputs)} flat arguments, got {len(flat_args)}")
        env.update(zip(self.inputs, flat_args))

        _run(self, 0, len(self.ops), env, _Hooks(before_op, after_op, None, apply_op), ())
        return [read(env, x) for x in self.outputs]

    def run_range(self, start: int, end: int, env: dict[int, Any], before_op=None, after_op=None,
                  scope=None, apply_op=None) -> None:
        """Runs ops [start, end) on `env` (tensor id -> value, updated in place) as `evaluate` does:
        a region wholly inside the range runs as its control flow (or custom call), one crossing its
        ends op by op. `scope(region)`, when given, is the context manager a custom call is bound
        in (the ops its derivative rule makes take that scope's name)."""
        _run(self, start, end, env, _Hooks(before_op, after_op, scope, apply_op), ())


def read(env: dict[int, Any], x: int | Literal) -> Any:
    """The value of an operand: a literal's own, a tensor's in `env`."""
    return x.value if isinstance(x, Literal) else env[x]


def tensor_of(aval) -> Tensor:
    """The `Tensor` of an abstract value (or of an array). A symbolic dimension (a step traced with
    `jax.export` shapes, `planner.graph.shape_family`) is kept as it is."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        raise InvalidArgumentError(f"value of type {aval} is not an array; the planner only handles array values")
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) are kept as they are
        pass
    return Tensor(tuple(d if jax.export.is_symbolic_dim(d) else int(d) for d in shape), dtype)


def matmul_flops(graph: Graph) -> dict[str, float]:
    """Matmul FLOPs per step by operand dtype: 2 x output size x contracted size of every dot_general
    (what model FLOP utilisation counts), under the narrower operand's dtype (a float32 softmax
    gradient times bfloat16 keys is a bfloat16 model matmul: fused attention runs it so, and MFU
    conventions count every model FLOP against the compute dtype's peak)."""
    out: dict[str, float] = {}
    for op in graph.ops:
        if op.name != "dot_general":
            continue
        lhs, rhs = (graph.tensors[x] if isinstance(x, int) else x.tensor for x in op.inputs[:2])
        key = str(min((lhs.dtype, rhs.dtype), key=lambda d: getattr(d, "itemsize", 8)))
        out[key] = out.get(key, 0.0) + dot_flops(graph, op)
    return out


def dot_flops(graph: Graph, op: Op) -> float:
    """2 x output size x contracted size of a `dot_general` op; 0 for any other op."""
    if op.name != "dot_general":
        return 0.0
    (lhs_contract, _), _ = op.params["dimension_numbers"]
    lhs = graph.tensors[op.inputs[0]] if isinstance(op.inputs[0], int) else op.inputs[0].tensor
    return 2.0 * graph.tensors[op.outputs[0]].size * math.prod(lhs.shape[d] for d in lhs_contract)


# ----- the interpreter behind `Graph.evaluate` and `Graph.run_range` ----------------------------
@dataclasses.dataclass(frozen=True)
class _Hooks:
    """What a run does around each op: `before_op(op, operands)` and `after_op(op, outputs)` may
    replace them; `scope(region)` is the context a custom call is bound in (None: no scope)."""

    before_op: Callable[[Op, list[Any]], list[Any]] | None
    after_op: Callable[[Op, list[Any]], list[Any]] | None
    scope: Callable[[Region], Any] | None
    apply_op: Callable[[Op, list[Any]], list[Any] | None] | None = None


def _run(graph: Graph, start: int, end: int, env: dict[int, Any], hooks: _Hooks, active: tuple) -> None:
    """Ops [start, end) on `env`; `active`: the regions and recompute groups already running."""
    i = start
    while i < end:
        # The largest region starting here that fits the range being run and is not already
        # running (a body may start, or even end, where its own region does; regions nest).
        region = next((r for r in graph.regions.get(i, ()) if r.end <= end and not any(r is a for a in active)),
                      None)
        if region is not None:
            outs = _run_region(graph, region, env, hooks, active + (region,))
            env.update((t, v) for t, v in zip(region.outputs, outs) if isinstance(t, int))
            i = region.end
            continue
        group = graph.recompute.get(i)
        if group is not None and group.end <= end and not any(group is a for a in active):
            _run_recompute(graph, i, group, env, hooks, active)
            i = group.end
            continue
        _run_op(graph.ops[i], env, hooks)
        i += 1


def _run_op(op: Op, env: dict[int, Any], hooks: _Hooks) -> None:
    operands = [read(env, x) for x in op.inputs]
    if hooks.before_op is not None:
        operands = hooks.before_op(op, operands)
    outs = hooks.apply_op(op, operands) if hooks.apply_op is not None else None
    if outs is None:
        result = bind(op.primitive, op.params, operands)
        outs = list(result) if op.primitive.multiple_results else [result]
    if hooks.after_op is not None:
        outs = hooks.after_op(op, outs)
    env.update(zip(op.outputs, outs))


def _run_recompute(graph: Graph, i: int, group: Recompute, env: dict[int, Any], hooks: _Hooks,
                   active: tuple) -> None:
    """The recompute group starting at op `i`, on its inputs passed through one barrier with its
    gate (`Recompute`)."""
    vals = jax.lax.optimization_barrier([env[t] for t in group.inputs] + [env[group.gate]])
    local = dict(env)
    args = set(graph.inputs)
    local.update(zip(group.inputs, _after(vals[:-1], vals[-1], [t in args for t in group.inputs])))
    _run(graph, i, group.end, local, hooks, active + (group,))
    env.update((t, local[t]) for op in graph.ops[i:group.end] for t in op.outputs)


def _body_fn(graph: Graph, body: Body, env: dict[int, Any], hooks: _Hooks, active) -> Callable[..., list[Any]]:
    def fn(*args):
        local = dict(env)
        local.update((t, v) for t, v in zip(body.inputs, args) if isinstance(t, int))
        _run(graph, body.start, body.end, local, hooks, active)
        return [read(local, x) for x in body.outputs]

    return fn


def _pin_results(graph: Graph, region: Region, outs: Sequence[Any], after_op) -> list[Any]:
    """`outs` (the region's results) placed where the plan decided them: each through `after_op`
    of the op that makes it in the planning expansion (a cond's select, a scan's stack)."""
    if after_op is None:
        return list(outs)
    producers = {t: op for op in graph.ops[region.start:region.end] for t in op.outputs}
    return [after_op(producers[t], [v])[0] if isinstance(t, int) and t in producers
            and len(producers[t].outputs) == 1 else v for t, v in zip(region.outputs, outs)]


def _run_scan(graph: Graph, region: Region, vals: list, env: dict[int, Any], hooks: _Hooks, active) -> list[Any]:
    p = region.params
    nc, nk = scan_counts(p)
    body = _body_fn(graph, region.bodies[0], env, hooks, active)

    def step(carry, x):
        out = body(*vals[:nc], *carry, *x)
        return out[:nk], out[nk:]

    carry, ys = jax.lax.scan(step, vals[nc:nc + nk], vals[nc + nk:], length=p["length"], reverse=p["reverse"])
    return list(carry) + list(ys)


def _run_cond(graph: Graph, region: Region, vals: list, env: dict[int, Any], hooks: _Hooks, active) -> list[Any]:
    # XLA requires every branch of a conditional to return its results in one sharding: the
    # cond's planned one, applied inside each branch
    branches = [lambda *a, f=_body_fn(graph, b, env, hooks, active): _pin_results(graph, region, f(*a), hooks.after_op)
                for b in region.bodies]
    return list(jax.lax.switch(vals[0], branches, *vals[1:]))


def _run_while(graph: Graph, region: Region, vals: list, env: dict[int, Any], hooks: _Hooks, active) -> list[Any]:
    p = region.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    test = jcore.jaxpr_as_fun(p["cond_jaxpr"])
    if p["cond_jaxpr"].out_avals[0].shape:  # a batched predicate (vmap): the equation itself
        # (the body jaxpr reads only its operands: the loop's constants and carries)
        body = _body_fn(graph, region.bodies[0], dict(graph.consts), hooks, active)
        return list(rebind(region.primitive, p, {"body_jaxpr": body}, vals))
    body = _body_fn(graph, region.bodies[0], env, hooks, active)
    return list(jax.lax.while_loop(lambda c: test(*vals[:cn], *c)[0],
                                   lambda c: tuple(body(*vals[cn:cn + bn], *c)), tuple(vals[cn + bn:])))


def _run_custom(graph: Graph, region: Region, vals: list, env: dict[int, Any], hooks: _Hooks, active) -> list[Any]:
    """A custom-derivative call: its body (a closed jaxpr: it reads only its operands and consts),
    bound again with the call's rule."""
    body = _body_fn(graph, region.bodies[0], dict(graph.consts), hooks, active)
    scope = hooks.scope(region) if hooks.scope is not None else contextlib.nullcontext()
    with scope:
        return list(rebind(region.primitive, region.params, {"call_jaxpr": body}, vals))


# How each kind of region runs its original control flow; any other kind is a custom call.
_REGION_RUNNERS = {"scan": _run_scan, "cond": _run_cond, "while": _run_while}


def _run_region(graph: Graph, region: Region, env: dict[int, Any], hooks: _Hooks, active) -> list[Any]:
    vals = [read(env, x) for x in region.operands]
    outs = _REGION_RUNNERS.get(region.kind, _run_custom)(graph, region, vals, env, hooks, active)
    if region.kind == "while":  # its carries keep their tied layout
        return outs
    return _pin_results(graph, region, outs, hooks.after_op)


def _after(values: Sequence[Any], gate: Any, skip: Sequence[bool]) -> list[Any]:
    """`values` made data-dependent on `gate`: x - 0 * gate[0, ..., 0], which is x when that element
    is finite (except that a -0 in x becomes +0 when that element is negative or -0; an inf or
    nan there, a non-finite gradient already, turns the recomputed values into nan).
    XLA removes optimization barriers before it schedules (OptimizationBarrierExpander), and XLA:CPU's
    default scheduler then computed the recomputation during the forward, saving no memory; an
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
