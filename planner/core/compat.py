"""The planner's few uses of JAX beyond its documented public API, in one place.

Each function says what it relies on. Everything else in the planner uses public JAX only.
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, slots=True)
class PallasGrid:
    """What a `pallas_call` equation's parameters say about its grid (`pallas_grid`).

    Attributes:
      name: the kernel's name (the `name` parameter, else its kernel function's from the body's
        debug info).
      grid: the grid's extent per axis (None for an axis sized at run time, e.g. megablox's tiles).
      index_operands: scalar-prefetch operands (no block mapping; their values steer the index
        maps); with the run-time grid sizes, they lead the operands (an op's first
        `len(operands) - (len(blocks) - num_outputs)`).
      num_outputs: the kernel's results (the last blocks).
      blocks: per operand after those, then per result: (array shape, per dimension the grid axis
        whose program id is that dimension's block index (None when the index map computes
        anything else), per dimension the block extent (1 for a squeezed dimension)).
      semantics: per grid axis "parallel" / "arbitrary" / ... where the compiler parameters state
        them (Mosaic TPU), else None (Triton: every program runs independently).
      body: the kernel's jaxpr.
      flops / bytes_accessed: the kernel's own `cost_estimate`, None when it has none.
    """

    name: str
    grid: tuple[int | None, ...]
    index_operands: int
    num_outputs: int
    blocks: tuple[tuple[tuple[int, ...], tuple[int | None, ...], tuple[int, ...]], ...]
    semantics: tuple[str, ...] | None
    body: Any
    flops: float | None
    bytes_accessed: float | None


def _block_extent(b: Any) -> int:
    """One entry of a `BlockMapping.block_shape`: an int, None / `Squeezed()` (extent 1) or a
    `Blocked(block_size=n)`-like record."""
    if b is None:
        return 1
    if isinstance(b, int):
        return b
    return int(getattr(b, "block_size", 1))


def pallas_grid(params: Mapping[str, Any]) -> PallasGrid | None:
    """The grid facts of a `pallas_call` equation (`PallasGrid`), or None when its parameters are
    not laid out as this reads them. Relies on `pallas_call`'s eqn parameters (`grid_mapping` with
    `grid`, `block_mappings` (`array_aval`, `block_shape`, `index_map_jaxpr`), `num_index_operands`,
    `num_inputs`, `num_outputs`; `compiler_params`'s `dimension_semantics`; `cost_estimate`;
    `name`; `jaxpr`), as jax 0.10 writes them."""
    try:
        gm = params["grid_mapping"]
        grid = tuple(int(g) if isinstance(g, int) else None for g in gm.grid)  # None: sized at run time
        blocks = []
        for bm in gm.block_mappings:
            index_map = bm.index_map_jaxpr.jaxpr
            grid_vars = list(index_map.invars[:len(grid)])
            axes = tuple(grid_vars.index(o) if not isinstance(o, jcore.Literal) and o in grid_vars else None
                         for o in index_map.outvars)
            shape = tuple(int(d) for d in bm.array_aval.shape)
            extents = tuple(_block_extent(b) for b in bm.block_shape)
            if len(axes) != len(shape) or len(extents) != len(shape):
                return None
            blocks.append((shape, axes, extents))
        if len(blocks) != gm.num_inputs + gm.num_outputs:
            return None
        semantics = getattr(params.get("compiler_params"), "dimension_semantics", None)
        semantics = tuple(str(getattr(s, "name", s)).lower() for s in semantics) if semantics else None
        cost = params.get("cost_estimate")
        return PallasGrid(str(params.get("name") or _kernel_function(params["jaxpr"])), grid, int(gm.num_index_operands), int(gm.num_outputs),
                          tuple(blocks),
                          semantics, params["jaxpr"], getattr(cost, "flops", None),
                          getattr(cost, "bytes_accessed", None))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _kernel_function(body: Any) -> str:
    """A kernel's function and where it is defined, from its body's debug info ("kernel at
    /path/gmm.py:301" -> "kernel (gmm.py:301)"); "pallas_call" without one."""
    source = getattr(getattr(body, "debug_info", None), "func_src_info", None) or ""
    name, _, where = source.partition(" at ")
    where = where.rsplit("/", 1)[-1]
    return f"{name} ({where})" if name and where and not where.startswith("<") else name or "pallas_call"


def pallas_call_on_shard(params: Mapping[str, Any], splits: Mapping[int, int]) -> dict[str, Any]:
    """`pallas_call` parameters for one device's shard of its operands, when grid axis `g` is split
    `splits[g]` ways (each a parallel axis of `pallas_grid`, its extent divisible): the grid and
    every array dimension whose block index is that axis's program id shrink by the split, the
    kernel body and index maps stay (their program ids count the shard's blocks). Relies on the
    same parameters as `pallas_grid`, and on `GridMapping` / `BlockMapping` being dataclasses
    whose `grid`, `block_mappings`, `array_aval` fields may be replaced."""
    gm = params["grid_mapping"]
    grid = tuple(g // splits[i] if i in splits else g for i, g in enumerate(gm.grid))
    mappings = []
    for bm in gm.block_mappings:
        index_map = bm.index_map_jaxpr.jaxpr
        grid_vars = list(index_map.invars[:len(grid)])
        shape = list(bm.array_aval.shape)
        for d, o in enumerate(index_map.outvars):
            if not isinstance(o, jcore.Literal) and o in grid_vars:
                shape[d] //= splits.get(grid_vars.index(o), 1)
        mappings.append(dataclasses.replace(bm, array_aval=bm.array_aval.update(shape=tuple(shape))))
    new = dataclasses.replace(gm, grid=grid, block_mappings=tuple(mappings))
    outs = tuple(bm.array_aval for bm in mappings[gm.num_inputs:])
    return dict(params, grid_mapping=new, out_avals=outs)


def called_from(eqn: Any, function: str) -> bool:
    """Whether `eqn` was traced inside a call of a Python function named `function` (its source
    traceback's frames; the equations of a transposed or linearised function keep the traceback of
    the primal's). Relies on `JaxprEqn.source_info.traceback.frames` (jaxlib `Traceback`,
    `Frame.function_name`); False where an equation has none."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(traceback, "frames", None) or ()
    return any(getattr(f, "function_name", None) == function for f in frames)


# Operators of `jax.export` dimension expressions that are not linear in their symbols (`_DimExpr`'s
# printed form names them: "floordiv(b, 2)", "mod(b, 4)", "max(b, 1)", "non_negative(b - 1)").
_NONLINEAR_DIM_OPS = ("floordiv", "mod", "max", "min", "non_negative")


def evaluate_dim(dim: Any, sizes: Mapping[str, int]) -> int:
    """A dimension of a symbolically traced shape (a `jax.export` dimension expression, or an int)
    at the symbols' `sizes`. Relies on `_DimExpr._evaluate` (jax.export has no public evaluation
    of a dimension expression)."""
    if not jax.export.is_symbolic_dim(dim):
        return int(dim)
    return int(dim._evaluate(dict(sizes)))


def dim_is_linear(dim: Any) -> bool:
    """Whether a dimension expression is linear in its symbols (no floor division, remainder, max
    or min): then it has one value per symbol size and no case split on the size. Reads the
    expression's printed form (`str` of a `_DimExpr`)."""
    return not (jax.export.is_symbolic_dim(dim) and any(f"{op}(" in str(dim) for op in _NONLINEAR_DIM_OPS))


def cross_process_transfers() -> bool:
    """Whether `jax.device_put` can move an array to devices another process owns: the backend
    says it supports cross-host transfers (`supports_cross_host_transfers` on the PJRT client,
    not public), or DCN transfers are configured (`jax_cross_host_transfer_socket_address`, read
    with `jax.config._read`, not public). Only the pipeline runtime needs it, to move activations
    between stages of different processes."""
    import jax.extend

    if getattr(jax.extend.backend.get_backend(), "supports_cross_host_transfers", False):
        return True
    try:
        return bool(jax.config._read("jax_cross_host_transfer_socket_address"))
    except (AttributeError, KeyError):  # a JAX without the flag: no DCN transfers
        return False
