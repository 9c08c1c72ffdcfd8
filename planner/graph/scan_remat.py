"""Recomputation of scanned layers: a step's jaxpr rewritten so that a scan's backward recomputes
what its forward saved (what `jax.checkpoint` around the scan body does), for steps whose model
scans its layers without a checkpoint of its own (MaxText's `scan_layers`, Flax `nn.scan`).

Under `jax.grad` a `lax.scan` becomes two scans (JAX's partial evaluation of the scan): a forward
scan F that, besides its own results, stacks per iteration the residuals the backward reads (for a
transformer layer: the normalised input, the q/k/v projections, the attention scores and
probabilities, the MLP's hidden activations: L copies of each), and a backward scan B, usually
`reverse=True`, that takes those stacks as scanned inputs. The rewrite (`rewrite`):

* F stacks its input carry per iteration (the layer's input, one [batch, seq, d_model] per layer)
  instead of the residuals;
* B scans that stack and F's own scanned inputs (the stacked weights) beside its other inputs, and
  its body first recomputes the residuals of its iteration from them: F's body evaluated for
  those outputs only (the ops they need, nothing else), under the name scope `remat`.

Policy "full" recomputes every residual; "dots" keeps (stacks) the results of the matmuls the
residuals need and recomputes the rest from them (`jax.checkpoint_policies.dots_saveable`),
"dots_no_batch" only those of matmuls without batch dimensions (`POLICIES`).

The rewritten step is evaluated by an interpreter over the original jaxpr (`rewrite` returns a
function of the step's flat arguments) and traced again like any step (`graph.trace`), so planning,
memory liveness and emission see real scans with the recomputation in B's body. The values are the
same as the original step's (the same primitives on the same operands).

The first layers only (`first=n`, Megatron-LM's `--recompute-num-layers` for a scanned stack):
F runs as two scans, iterations [0, n) rewritten as above and [n, L) as the original body stacking
its residuals; B (reversed) runs [n, L) on those residuals, then [0, n) recomputing. Each part reads
its rows of the whole stacked operands by index (`_ranged`), so no part of a stacked weight is
copied; the per-layer results of each part (B's weight gradients) are concatenated, the layout the
planner prices as the original scan's stacking (written into one carried buffer instead, every
layer's weight-gradient partial sum was reduced inside the loop: priced 4x the communication).

Out of scope: a scan pair inside a nested `jit` or control flow (only the step's top level is
rewritten; the plan says no scan was recomputed), and residuals that are not stacked scan outputs
(loop-invariant residuals are computed once outside the loop by JAX itself).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal as JaxLiteral, jaxpr_as_fun

from planner.core.compat import apply_equation, called_from, scan_counts
from planner.core.layer_index import with_fused_attention
from planner.graph.ir import Graph
from planner.graph.trace import ATTENTION_CORE, trace

# Matmul-like primitives whose results "dots" keeps (jax.checkpoint_policies.dots_saveable).
SAVEABLE = frozenset({"dot_general", "conv_general_dilated"})

# "full": recompute everything; "dots": keep matmul and convolution results
# (`jax.checkpoint_policies.dots_saveable`); "dots_no_batch": keep the results of matmuls without
# batch dimensions, the projections, and recompute the batched ones, attention's scores and
# weighted values (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`).
POLICIES = ("full", "dots", "dots_no_batch")


def keeps(primitive: str, params: Any, policy: str) -> bool:
    """Whether `policy` keeps (does not recompute) the result of a `primitive` op with `params`
    (never one inside `jax.nn.dot_product_attention`'s core: a fused attention kernel saves its
    output and recomputes its scores, as MaxText's "minimal_flash" policy does; the callers check)."""
    if policy == "dots":
        return primitive in SAVEABLE
    if policy == "dots_no_batch":
        return primitive == "dot_general" and not params["dimension_numbers"][1][0]
    return False

# Name scope of the recomputed ops inside the backward scan's body.
SCOPE = "planner_remat"


def is_recomputed(name_stack: str) -> bool:
    """Whether an op of that name stack is a recomputation `rewrite` placed in a backward scan."""
    return SCOPE in name_stack.split("/")


@dataclasses.dataclass(frozen=True)
class Pair:
    """A forward scan (equation `forward`) whose stacked outputs `residuals` (positions among its
    scanned outputs) only the backward scan (equation `backward`) reads, at its operand positions
    `slots` (same order)."""

    forward: int
    backward: int
    residuals: tuple[int, ...]
    slots: tuple[int, ...]


def scan_pairs(jaxpr: Jaxpr) -> list[Pair]:
    """The (forward, backward) scan pairs of `jaxpr`'s top level that a rewrite can recompute."""
    users: dict[Any, list[tuple[int, int]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for k, v in enumerate(eqn.invars):
            if not isinstance(v, JaxLiteral):
                users.setdefault(v, []).append((i, k))
    returned = {v for v in jaxpr.outvars if not isinstance(v, JaxLiteral)}
    pairs = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        _, nk = scan_counts(eqn.params)
        by_backward: dict[int, list[tuple[int, int]]] = {}
        for j, v in enumerate(eqn.outvars[nk:]):
            where = users.get(v, [])
            if v in returned or not where:
                continue
            targets = {u for u, _ in where}
            if len(targets) != 1:
                continue
            (u,) = targets
            other = jaxpr.eqns[u]
            if other.primitive.name != "scan" or other.params["length"] != eqn.params["length"]:
                continue
            unc, unk = scan_counts(other.params)
            slots = [k for _, k in where]
            if len(slots) != 1 or slots[0] < unc + unk:  # read once, as a scanned input
                continue
            by_backward.setdefault(u, []).append((j, slots[0]))
        for u, found in by_backward.items():
            pairs.append(Pair(i, u, tuple(j for j, _ in found), tuple(k for _, k in found)))
    # one backward scan per forward scan (JAX's partial evaluation makes exactly one)
    return [p for p in pairs if sum(q.forward == p.forward for q in pairs) == 1]


def _needed(jaxpr: Jaxpr, outs: Sequence[Any], known: set) -> list[int]:
    """Indices of the equations of `jaxpr` that computing `outs` needs, given the values `known`."""
    need = {v for v in outs if not isinstance(v, JaxLiteral) and v not in known}
    keep = []
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in need for v in eqn.outvars):
            keep.append(i)
            need.update(v for v in eqn.invars if not isinstance(v, JaxLiteral) and v not in known)
    return keep[::-1]


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], env: dict, eqns: Sequence[int], outs: Sequence[Any]) -> list[Any]:
    """The values of `outs`, evaluating equations `eqns` of `jaxpr` over `env` (variable -> value)."""
    env = dict(env)
    env.update(zip(jaxpr.constvars, consts))

    def read(v):
        return v.val if isinstance(v, JaxLiteral) else env[v]

    for i in eqns:
        eqn = jaxpr.eqns[i]
        with _scope(eqn):
            result = apply_equation(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, result))
    return [read(v) for v in outs]


def _scope(eqn):
    """The name scope `eqn` was traced under (so that the tracer names its op as before), with the
    attention core's mark (`trace.ATTENTION_CORE`: the traced-again op's source is this interpreter)."""
    name = str(eqn.source_info.name_stack)
    if called_from(eqn, ATTENTION_CORE):
        name = with_fused_attention(name)
    return jax.named_scope(name) if name else contextlib.nullcontext()


def _saved(body: Jaxpr, residual_vars: Sequence[Any], policy: str) -> list[Any]:
    """The body variables a rewritten forward scan keeps (stacks) under `policy` (`keeps`): the
    matmul results the residuals depend on; none under "full"."""
    if policy == "full":
        return []
    invars = set(body.invars) | set(body.constvars)
    cone = _needed(body, residual_vars, invars)
    core = {i for i, e in enumerate(body.eqns) if called_from(e, ATTENTION_CORE)}
    # a fused attention keeps its output only (MaxText's "minimal_flash" keeps the "context"):
    # values its core makes for itself are recomputed by its backward kernel
    leaves = {v for v in body.outvars if not isinstance(v, JaxLiteral)} | {
        v for i, e in enumerate(body.eqns) if i not in core for v in e.invars if not isinstance(v, JaxLiteral)}
    return [v for i in cone for v in body.eqns[i].outvars
            if keeps(body.eqns[i].primitive.name, body.eqns[i].params, policy) and (i not in core or v in leaves)]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one pair is rewritten: the forward body, the residual variables it recomputes, the
    ones it keeps (`saved`), and the backward equation's operand layout."""

    pair: Pair
    body: ClosedJaxpr
    residual_vars: tuple[Any, ...]
    saved: tuple[Any, ...]


def _ranged(step: Callable, carry: Any, full: Sequence[Any], stacked: Any, start: int, stop: int, reverse: bool,
            unroll: Any) -> tuple[Any, Any]:
    """`lax.scan` of `step(carry, index, row of each `full` array at that index, stacked row)` over
    the indices [start, stop): the iterations of a split scan read their rows of the whole stacked
    operands (no copy of a part of them), `stacked` holds stop - start rows."""
    def body(carry, xs):
        i, row = xs
        return step(carry, i, [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in full], row)

    return jax.lax.scan(body, carry, (jax.numpy.arange(start, stop), stacked), length=stop - start,
                        reverse=reverse, unroll=unroll)


def _forward(plan: _Plan, eqn, vals: list[Any], first: int | None = None) -> list[Any]:
    """The forward scan, stacking its input carry and the kept matmul results instead of the
    residuals; returns the equation's results in its order, with the stacks appended (the
    residual slots hold None). With `first` (`rewrite`): only its first `first` iterations so, the
    others as the original scan, whose residual stacks fill the residual slots."""
    p = eqn.params
    nc, nk = scan_counts(p)
    body = plan.body
    res = set(plan.pair.residuals)
    xs = vals[nc + nk:]

    def recomputed(carry, x):
        outs, saved = _body_outputs(body, plan.saved, list(vals[:nc]) + list(carry) + list(x))
        ys = [y for j, y in enumerate(outs[nk:]) if j not in res]
        return outs[:nk], (ys, list(carry), saved)

    if first is None:
        carry, (ys, carries, saved) = jax.lax.scan(recomputed, vals[nc:nc + nk], xs, length=p["length"],
                                                   reverse=p["reverse"], unroll=p.get("unroll", 1))
        it = iter(ys)
        return list(carry) + [None if j in res else next(it) for j in range(len(eqn.outvars) - nk)], (carries, saved)

    def plain(carry, i, x, row):  # the original body: every stacked output, residuals included
        outs = jaxpr_as_fun(body)(*(list(vals[:nc]) + list(carry) + list(x)))
        return outs[:nk], outs[nk:]

    unroll = p.get("unroll", 1)
    carry, (ys, carries, saved) = _ranged(lambda c, i, x, row: recomputed(c, x), vals[nc:nc + nk], xs, (),
                                          0, first, False, unroll)
    carry, rest = _ranged(plain, carry, xs, (), first, p["length"], False, unroll)
    it = iter(ys)
    full = [rest[j] if j in res else jax.numpy.concatenate([next(it), rest[j]]) for j in range(len(rest))]
    return list(carry) + full, (carries, saved)


def _body_outputs(body: ClosedJaxpr, saved_vars: Sequence[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
    """The forward body's outputs on `args`, and the values of `saved_vars` (evaluated once)."""
    j = body.jaxpr
    env = dict(zip(j.invars, args))
    outs = list(j.outvars) + list(saved_vars)
    values = _eval(j, body.consts, env, range(len(j.eqns)), outs)
    return values[:len(j.outvars)], values[len(j.outvars):]


def _backward(plan: _Plan, f_eqn, f_vals: list[Any], stacks, eqn, vals: list[Any],
              first: int | None = None) -> list[Any]:
    """The backward scan, its residuals recomputed per iteration from the forward's stacked input
    carries, scanned inputs and kept matmul results (`stacks`), with the forward's constants. With
    `first`: the iterations after the first `first` run first (the scan is reversed) as the
    original scan on the residuals the forward stacked for them, then the first `first`
    recomputing theirs; both read their rows of the whole scanned operands (no copies of parts),
    and their stacked results are concatenated."""
    p = eqn.params
    nc, nk = scan_counts(p)
    fnc, fnk = scan_counts(f_eqn.params)
    f_consts, f_xs = f_vals[:fnc], f_vals[fnc + fnk:]
    carries, saved = stacks
    slots = dict(zip(plan.pair.slots, range(len(plan.pair.slots))))
    other = [k for k in range(nc + nk, len(vals)) if k not in slots]
    body, fbody = p["jaxpr"], plan.body.jaxpr
    known = set(fbody.invars) | set(fbody.constvars) | set(plan.saved)
    recompute_eqns = _needed(fbody, plan.residual_vars, known)

    def args_of(carry, own, res):  # `res`: the residuals in `plan.residual_vars` order
        own_it = iter(own)
        return list(vals[:nc]) + list(carry) + [res[slots[k]] if k in slots else next(own_it)
                                                for k in range(nc + nk, len(vals))]

    def recompute(carry_i, fx_i, saved_i):
        env = dict(zip(fbody.invars, list(f_consts) + list(carry_i) + list(fx_i)))
        env.update(zip(plan.saved, saved_i))
        with jax.named_scope(SCOPE):
            return _eval(fbody, plan.body.consts, env, recompute_eqns, plan.residual_vars)

    own_xs = [vals[k] for k in other]
    if first is None:
        def step(carry, xs):
            own, carry_i, fx_i, saved_i = xs
            out = jaxpr_as_fun(body)(*args_of(carry, own, recompute(carry_i, fx_i, saved_i)))
            return out[:nk], out[nk:]

        carry, ys = jax.lax.scan(step, vals[nc:nc + nk], (own_xs, carries, f_xs, saved), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
        return list(carry) + list(ys)

    unroll = p.get("unroll", 1)

    def late(carry, i, x, res):  # the original body on the residuals the forward stacked
        out = jaxpr_as_fun(body)(*args_of(carry, x, res))
        return out[:nk], out[nk:]

    def early(carry, i, x, row):  # recomputing its residuals
        own, fx_i = x[:len(own_xs)], x[len(own_xs):]
        out = jaxpr_as_fun(body)(*args_of(carry, own, recompute(row[0], fx_i, row[1])))
        return out[:nk], out[nk:]

    carry, ys_late = _ranged(late, vals[nc:nc + nk], own_xs, [vals[k] for k in plan.pair.slots], first,
                             p["length"], True, unroll)
    carry, ys = _ranged(early, carry, own_xs + list(f_xs), (carries, saved), 0, first, True, unroll)
    return list(carry) + [jax.numpy.concatenate([a, b]) for a, b in zip(ys, ys_late)]


def _plans(jaxpr: Jaxpr, policy: str) -> dict[int, _Plan]:
    """How each recomputable scan pair of `jaxpr` is rewritten, by its forward equation."""
    plans: dict[int, _Plan] = {}
    for pair in scan_pairs(jaxpr):
        eqn = jaxpr.eqns[pair.forward]
        _, nk = scan_counts(eqn.params)
        body = eqn.params["jaxpr"]
        residual_vars = tuple(body.jaxpr.outvars[nk + j] for j in pair.residuals)
        if any(isinstance(v, JaxLiteral) for v in residual_vars):
            continue
        plans[pair.forward] = _Plan(pair, body, residual_vars, tuple(_saved(body.jaxpr, residual_vars, policy)))
    return plans


def _split_length(jaxpr: Jaxpr, plans: dict[int, _Plan]) -> int | None:
    """The common length of `plans`' scans when each pair can recompute its first iterations only:
    its forward scan runs forward, its backward scan in reverse (as `jax.grad` makes them)."""
    lengths = set()
    for pl in plans.values():
        f, b = jaxpr.eqns[pl.pair.forward].params, jaxpr.eqns[pl.pair.backward].params
        if f["reverse"] or not b["reverse"]:
            return None
        lengths.add(f["length"])
    return lengths.pop() if len(lengths) == 1 else None


def rewrite(closed: ClosedJaxpr, policy: str, first: int | None = None
            ) -> tuple[Callable[..., list[Any]], int] | None:
    """(a function of the step's flat arguments computing its flat results with every recomputable
    scan pair rewritten under `policy`, the number of pairs), or None when `closed` has none.
    `first`: only the first `first` layers (iterations) of each stack recompute (Megatron-LM's
    `--recompute-num-layers`, `levers.remat`), the others keep their residuals as the original
    scans do; None (no such rewrite) unless 0 < first < the stacks' common length (`split_length`)."""
    if policy not in POLICIES:
        raise ValueError(f"scan recomputation policy {policy!r} must be one of {POLICIES}")
    jaxpr = closed.jaxpr
    plans = _plans(jaxpr, policy)
    if not plans:
        return None
    if first is not None and not 0 < first < (_split_length(jaxpr, plans) or 0):
        return None
    backward_of = {pl.pair.backward: pl for pl in plans.values()}

    def fn(*args: Any) -> list[Any]:
        env = dict(zip(jaxpr.invars, args))
        env.update(zip(jaxpr.constvars, closed.consts))
        stacks: dict[int, tuple] = {}

        def read(v):
            return v.val if isinstance(v, JaxLiteral) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            vals = [read(v) for v in eqn.invars]
            with _scope(eqn):
                if i in plans:
                    result, stacks[i] = _forward(plans[i], eqn, vals, first)
                elif i in backward_of:
                    pl = backward_of[i]
                    f_eqn = jaxpr.eqns[pl.pair.forward]
                    result = _backward(pl, f_eqn, [read(v) for v in f_eqn.invars], stacks[pl.pair.forward], eqn, vals,
                                       first)
                else:
                    result = apply_equation(eqn, vals)
            env.update(zip(eqn.outvars, result))  # a recomputed residual: None (only the backward read it)
        return [read(v) for v in jaxpr.outvars]

    return fn, len(plans)


def _rewritable(graph: Graph) -> bool:
    """Whether `graph` is a step as traced (its jaxpr still describes it) not rewritten yet."""
    src = graph.source
    return src is not None and src.ops is graph.ops and not src.scans_recomputed


def recomputable_scans(graph: Graph) -> int:
    """How many scan pairs of `graph` `recompute_scans` can rewrite (0 for a transformed graph)."""
    if not _rewritable(graph):
        return 0
    return graph.cached(("recomputable_scans",), lambda: len(_plans(graph.source.jaxpr.jaxpr, "full")))


def split_length(graph: Graph) -> int | None:
    """The layers per stack `recompute_scans(first=)` can choose the first of (the stacks' common
    length), or None where it cannot (no stack, stacks of several lengths, a scan direction other
    than `jax.grad`'s, or a transformed graph)."""
    if not recomputable_scans(graph):
        return None
    jaxpr = graph.source.jaxpr.jaxpr
    return graph.cached(("scan_split_length",), lambda: _split_length(jaxpr, _plans(jaxpr, "full")))


def recompute_scans(graph: Graph, policy: str, first: int | None = None) -> Graph:
    """`graph` traced again with every scan pair's residuals recomputed under `policy` (module
    docstring), in the first `first` layers of each stack only where given (`rewrite`); `graph`
    itself when it has none, was transformed since it was traced, or cannot split at `first`."""
    if not _rewritable(graph):
        return graph
    made = rewrite(graph.source.jaxpr, policy, first)
    if made is None:
        return graph
    fn, n = made

    def step(*args: Any) -> Any:
        return jax.tree_util.tree_unflatten(graph.out_tree, fn(*jax.tree_util.tree_leaves(args)))

    abstract = jax.tree_util.tree_unflatten(
        graph.in_tree, [jax.ShapeDtypeStruct(graph.tensors[t].shape, graph.tensors[t].dtype) for t in graph.inputs])
    out = trace(step, *abstract, user_constraints=graph.user_constraints)
    out = dataclasses.replace(out, input_paths=graph.input_paths, output_paths=graph.output_paths)
    return dataclasses.replace(out, source=dataclasses.replace(out.source, ops=out.ops, scans_recomputed=n,
                                                               scan_first=first))
