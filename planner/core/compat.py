"""The planner's few uses of JAX beyond its documented public API, in one place.

Each function says what it relies on. Everything else in the planner uses public JAX only.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

# Primitives of the user's own sharding annotations (`with_sharding_constraint`, `jax.sharding.reshard`).
# The planner decides their results' sharding (pinned to the user's spec by default) and emission
# applies it, so re-evaluating them is the identity.
USER_CONSTRAINTS = frozenset({"sharding_constraint", "reshard"})
# The primitive of the sharding constraints the planner itself adds: pins where a nested `jax.jit`
# states in/out shardings (`graph.trace`) and pinned `checkpoint_name` values (`configs.pins`).
# Planned and evaluated exactly as a user's `with_sharding_constraint` (never bound).
PLANNER_CONSTRAINT = jcore.Primitive("sharding_constraint")
# Op parameters that may name a sharding of the traced mesh (explicit-axis tracing).
_SHARDING_PARAMS = ("out_sharding", "sharding")


def user_sharding(op_params: Mapping[str, Any]):
    """The `NamedSharding` a user's constraint op asks for (the `sharding` parameter of
    `sharding_constraint`, `dst_sharding` of `reshard`: eqn parameters, not public API)."""
    return op_params.get("sharding", op_params.get("dst_sharding"))


def _auto_mesh(mesh):
    """`mesh` with every axis Auto (same devices, names and sizes)."""
    types = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)
    return jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names), axis_types=types)


def _plain_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Params with shardings of explicit-axis meshes dropped: the program is re-evaluated on an Auto
    view of the mesh, where the plan's constraints place every result instead."""
    out = dict(params)
    for key in _SHARDING_PARAMS:
        s = out.get(key)
        mesh = getattr(s, "mesh", None)
        if mesh is not None and any(t != jax.sharding.AxisType.Auto for t in getattr(mesh, "axis_types", ())):
            out[key] = None
    return out


def bind(primitive: jcore.Primitive, params: Mapping[str, Any], operands: Sequence[Any]) -> Any:
    """Applies one traced primitive to `operands` (what `jax.core.eval_jaxpr` does per equation).

    - the user's sharding constraints: identity (see `USER_CONSTRAINTS`);
    - `shard_map`: rebuilt with the public `jax.shard_map` from its eqn parameters (`jaxpr`, `mesh`,
      `in_specs`, `out_specs`, `check_vma`, `newly_manual_axes`); its mesh is taken Auto, as the
      rest of the program is evaluated on an Auto view of the same devices;
    - others: `Primitive.bind` with explicit-axis shardings dropped from their parameters.
    """
    name = primitive.name
    if name in USER_CONSTRAINTS:
        return operands[0]
    if name == "shard_map":
        body = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(params["jaxpr"], ()))
        fn = jax.shard_map(lambda *xs: tuple(body(*xs)), mesh=_auto_mesh(params["mesh"]),
                           in_specs=tuple(params["in_specs"]), out_specs=tuple(params["out_specs"]),
                           check_vma=params.get("check_vma", True),
                           axis_names=set(params.get("newly_manual_axes", ())))
        return list(fn(*operands))
    return primitive.bind(*operands, **_plain_params(params))


def rebind(primitive: jcore.Primitive, params: Mapping[str, Any], bodies: Mapping[str, Any],
           operands: Sequence[Any]) -> Any:
    """Binds a traced control-flow or call equation again with some of its bodies replaced:
    `bodies[key]` (a function returning a list) becomes the closed jaxpr of parameter `key`,
    traced at that jaxpr's input types; every other parameter is the equation's own.

    Used where the public wrappers cannot say what the equation does: a custom-derivative call
    (`custom_jvp_call` / `custom_vjp_call`: its body with the equation's own derivative rule) and a
    `while` whose predicate is batched (what `vmap` of a `while_loop` makes: the loop runs while any
    element's predicate holds and updates only those, which `jax.lax.while_loop` cannot express).
    Relies on the parameter names of those equations and on `Primitive.get_bind_params`, which
    turns stored parameters into what `bind` takes (what `jax.core.eval_jaxpr` does per equation).
    """
    new = dict(params)
    for key, fn in bodies.items():
        avals = params[key].in_avals
        new[key] = jax.make_jaxpr(lambda *xs, fn=fn: tuple(fn(*xs)))(
            *(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals))
    return primitive.bind(*operands, **primitive.get_bind_params(new))


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """(constants, carries) among a `scan` equation's operands, in that order before the scanned
    inputs. jax 0.10 states them as the `num_consts` / `num_carry` parameters; jax 0.11 replaced
    those with `ft_in`, a flat tree packing (constants, carries, scanned inputs) whose parts count
    their leaves with `len`."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def apply_equation(eqn: Any, operands: Sequence[Any]) -> list[Any]:
    """One jaxpr equation applied to `operands`, as `jax.core.eval_jaxpr` applies it: its primitive
    bound with `Primitive.get_bind_params` of its stored parameters, under its own context
    (`eqn.ctx.manager`); the results as a list. The caller sets the name scope. Relies on the
    equation's fields (`primitive`, `params`, `ctx`), which `jax.extend.core.JaxprEqn` exposes."""
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with ctx if ctx is not None else _Nothing():
        out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


class _Nothing:
    """A context manager that does nothing (an equation without a context of its own)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
