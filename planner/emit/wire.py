"""Emitting the plan's wire formats (`Plan.wire`, chosen and priced in `planner.ilp.wire`).

- A split contraction whose partial sums the plan reduces in float32 runs with
  `preferred_element_type=float32`; its float32 result is pinned to the planned (reduced) layout, so
  XLA reduces the float32 partial sums, and only then is it rounded to the result's dtype: the
  unsharded contraction's single rounding.
- A gradient the plan reduces as int8 (ZeRO++'s qgZ) runs in `jax.shard_map`: each device's float32
  partial sums cut into one chunk per device, quantised, exchanged by one all-to-all, dequantised and
  summed in float32 (`reduce_int8`); the compiled program's all-to-alls carry s8.
- A weight the plan gathers as int8 is quantised where it lies (one bf16 scale per block of its last
  dimension, packed beside the block's int8 values: one buffer, one collective), the packed buffer
  is pinned first to the source layout and then to the layout the op reads (XLA gathers the int8
  buffer), and dequantised there. The compiled program's all-gathers carry s8.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from planner.core.compat import bind
from planner.core.plan import Plan
from planner.core.sharding import Spec, named_sharding, to_partition_spec
from planner.emit.kernels import kernel_hook
from planner.graph.ir import Graph, Op
from planner.ilp.wire import gradient_chunks, largest_block

Hook = Callable[[Op, list[Any]], Any]


def op_hooks(plan: Plan, mesh: jax.sharding.Mesh, graph: Graph, before_op: Hook) -> tuple[Hook, Hook | None]:
    """(before_op, apply_op) hooks of `Graph.evaluate` / `Graph.run_range` for `plan` on `mesh`:
    `before_op` (`emit.single.constraint_hooks`'s) with the int8 weight gathers in place of those
    reads' constraints; `apply_op` running float32 partial sums and split Pallas kernels
    (`emit.kernels.kernel_hook`) on their shards; None where there is nothing to apply."""
    on_shards = kernel_hook(plan, mesh, graph)
    partial = {w.op: np.dtype(w.dtype) for w in plan.wire if w.kind == "partial-sum" and w.op < len(graph.ops)}
    gathers = {(w.op, w.pos): w.block for w in plan.wire if w.kind == "gather" and w.op < len(graph.ops)}
    reduces = {w.op: w for w in plan.wire if w.kind == "reduce" and w.op < len(graph.ops)}
    if not partial and not gathers and not reduces:
        return before_op, on_shards
    shardings = {(i, k): named_sharding(s, plan.mesh, mesh) for i, k, s in plan.op_specs}
    scattered = {(i, k): named_sharding(s, plan.mesh, mesh) for i, k, s in plan.scatter_specs}
    sources = _source_specs(plan, graph)
    reads = {(i, k): s for i, k, s in plan.operand_specs}
    results = {(i, k): s for i, k, s in plan.op_specs}

    def apply(op: Op, operands: list[Any]) -> list[Any] | None:
        if op.index in reduces and (op.index, 0) in results:
            w = reduces[op.index]
            in_specs = [reads.get((op.index, k), sources.get(x)) for k, x in enumerate(op.inputs)]
            return [reduce_int8(op, graph, operands, in_specs, results[(op.index, 0)], w.axes, w.pos, plan, mesh)]
        if op.index in partial:
            wide = bind(op.primitive, dict(op.params, preferred_element_type=partial[op.index]), operands)
            for pins in (scattered, shardings):  # reduced (then scattered) in float32, as planned
                if (op.index, 0) in pins:
                    wide = jax.lax.with_sharding_constraint(wide, pins[(op.index, 0)])
            return [wide.astype(graph.tensors[op.outputs[0]].dtype)]
        return on_shards(op, operands) if on_shards is not None else None

    if not gathers:
        return before_op, apply

    def before(op: Op, operands: list[Any]) -> list[Any]:
        quantized = {k: v for k, v in enumerate(operands)
                     if (op.index, k) in gathers and (op.index, k) in reads and op.inputs[k] in sources}
        operands = before_op(op, operands)
        for k, v in quantized.items():
            operands[k] = gather_int8(v, sources[op.inputs[k]], reads[(op.index, k)], gathers[(op.index, k)],
                                      plan, mesh)
        return operands

    return before, apply


def _source_specs(plan: Plan, graph: Graph) -> dict[int, Spec]:
    """Tensor id -> the layout the plan gives it where it is made (arguments, op results)."""
    out = {t: s for t, s in zip(graph.inputs, plan.input_specs)}
    for i, k, s in plan.op_specs:
        if i < len(graph.ops) and k < len(graph.ops[i].outputs):
            out[graph.ops[i].outputs[k]] = s
    return out


def _packed(spec: Spec) -> Spec:
    """The layout of the packed [..., blocks, block + 2] buffer of a tensor laid out as `spec`."""
    return tuple(spec) + ((),)


def quantize(x: jax.Array, block: int) -> jax.Array:
    """x as int8 blocks of `block` elements of its last dimension, each with its bf16 absmax / 127
    scale packed after it (two bytes): shape x.shape[:-1] + (n / block, block + 2), int8."""
    blocks = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // block, block))
    scale = (jnp.max(jnp.abs(blocks), axis=-1) / 127.0).astype(jnp.bfloat16)
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale)).astype(jnp.float32)
    q = jnp.clip(jnp.round(blocks / safe[..., None]), -127, 127).astype(jnp.int8)
    return jnp.concatenate([q, jax.lax.bitcast_convert_type(scale, jnp.int8)], axis=-1)


def dequantize(packed: jax.Array, block: int, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of `quantize` (to its rounding): the tensor of `shape` in `dtype`."""
    scale = jax.lax.bitcast_convert_type(packed[..., block:], jnp.bfloat16).astype(jnp.float32)
    values = packed[..., :block].astype(jnp.float32) * scale[..., None]
    return values.reshape(shape).astype(dtype)


def gather_int8(x: jax.Array, src: Spec, dst: Spec, block: int, plan: Plan, mesh: jax.sharding.Mesh) -> jax.Array:
    """`x`, laid out as `src`, resharded to `dst` through its int8 packing (module docstring)."""
    packed = jax.lax.with_sharding_constraint(quantize(x, block), named_sharding(_packed(src), plan.mesh, mesh))
    packed = jax.lax.with_sharding_constraint(packed, named_sharding(_packed(dst), plan.mesh, mesh))
    return jax.lax.with_sharding_constraint(dequantize(packed, block, x.shape, x.dtype),
                                            named_sharding(dst, plan.mesh, mesh))


def _moved_chunks(x: jax.Array, d: int, n: int) -> jax.Array:
    """x with dimension d cut into n chunks, the chunk index first: [n, x.shape[d] / n, other dims]."""
    x = jnp.moveaxis(x, d, 0)
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def _unmoved(chunks: jax.Array, d: int) -> jax.Array:
    """The inverse of `_moved_chunks`."""
    x = chunks.reshape((chunks.shape[0] * chunks.shape[1],) + chunks.shape[2:])
    return jnp.moveaxis(x, 0, d)


def _exchange(part: jax.Array, dim: int, n: int, names: tuple[str, ...], scatter: bool) -> jax.Array:
    """Inside `jax.shard_map`: this device's float32 partial sums `part` over mesh axes `names`
    (`n` devices) reduced as qgZ does (`reduce_int8`): the reduced chunk along `dim` (`scatter`),
    else the whole reduced value, float32."""
    chunks = _moved_chunks(part, dim, n)
    block = largest_block(chunks.shape[-1])
    got = jax.lax.all_to_all(quantize(chunks, block), names, 0, 0, tiled=False)
    mine = jnp.sum(dequantize(got, block, chunks.shape, jnp.float32), axis=0)  # [chunk, other dims]
    if scatter:
        return jnp.moveaxis(mine, 0, dim)
    every = jax.lax.all_gather(quantize(mine, block), names, axis=0, tiled=False)  # mine: chunks' last dim
    return _unmoved(dequantize(every, block, (n,) + mine.shape, jnp.float32), dim)


def reduce_int8(op: Op, graph: Graph, operands: list[Any], in_specs: list[Spec], out: Spec,
                axes: tuple[int, ...], dim: int, plan: Plan, mesh: jax.sharding.Mesh) -> jax.Array:
    """Contraction `op`'s partial sums over mesh `axes` reduced as ZeRO++'s qgZ does
    (arXiv:2306.10209, 4.2): each device's float32 partial sum cut into one chunk per device along
    `dim`, quantised to int8 blocks, exchanged by one all-to-all, dequantised and summed in float32;
    where the plan keeps the result whole over `axes` (`out` has them nowhere), the reduced chunks
    quantised again and all-gathered as int8. Runs in `jax.shard_map` on the operands' layouts."""
    names = tuple(plan.mesh.axis_names[a] for a in axes)
    n = plan.mesh.axis_size(axes)
    dtype = graph.tensors[op.outputs[0]].dtype
    scatter = any(a in out[dim] for a in axes)
    cpu = mesh.devices.flat[0].platform == "cpu"

    def local(*xs):
        if cpu:  # XLA:CPU runs no bf16 x bf16 -> f32 dot inside shard_map; f32 operands give the same
            xs = [x.astype(jnp.float32) for x in xs]  # products (exact in float32) and float32 sums
        part = bind(op.primitive, dict(op.params, preferred_element_type=np.dtype(np.float32)), xs)
        return _exchange(part, dim, n, names, scatter).astype(dtype)

    pspec = lambda s: to_partition_spec(s, plan.mesh)  # noqa: E731
    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(pspec(s) for s in in_specs), out_specs=pspec(out),
                       check_vma=False)
    return fn(*operands)


# ops a parameter's gradient passes through from the contractions that make it (the cast back to the
# master weights' dtype, the sum over the parameter's uses, layout changes)
_GRADIENT_PATH = frozenset({"convert_element_type", "add", "add_any", "reshape", "transpose", "copy", "squeeze"})


def replica_wire(plan: Plan, graph: Graph, grads: tuple[Any, ...], axes: tuple[str, ...]) -> tuple[str, ...]:
    """Per parameter gradient `grads` (tensor ids of `graph`, the stage program `plan` is made
    for): the format of its once-per-step reduction over the data-parallel replica `axes` (names)
    in the pipeline runtime, as the plan priced it: "int8" where the plan exchanges a contraction
    making it as int8 chunks over one of `axes` (a "reduce" record), else the dtype of that
    contraction's partial sums under comm_precision "bf16" / "int8" (reduced in the results'
    dtype), else "float32" (the gradient accumulator's own, as "exact" prices it)."""
    names = set(axes)
    int8_ops = {w.op for w in plan.wire if w.kind == "reduce" and names & {plan.mesh.axis_names[a] for a in w.axes}}
    narrow = plan.options.comm_precision != "exact"
    producer = {t: op for op in graph.ops for t in op.outputs}

    def fmt(g: Any) -> str:
        found, stack, seen = "float32", [g] if isinstance(g, int) else [], set()
        while stack:
            op = producer.get(stack.pop())
            if op is None or op.index in seen:
                continue
            seen.add(op.index)
            if op.index in int8_ops:
                return "int8"
            if op.name in ("dot_general", "conv_general_dilated"):
                dt = graph.tensors[op.outputs[0]].dtype
                if narrow and jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
                    found = str(dt)
            elif op.name in _GRADIENT_PATH:
                stack.extend(op.tensor_inputs)
        return found

    return tuple(fmt(g) for g in grads)


def reduce_replicas(acc: jax.Array, fmt: str, sharding: jax.sharding.NamedSharding,
                    axes: tuple[str, ...]) -> jax.Array:
    """A gradient accumulated per data-parallel replica (`acc`: [replicas, *parameter shape], the
    replica dimension split over mesh `axes`, the rest laid out as `sharding`) summed over the
    replicas in `fmt` (`replica_wire`): float32, the narrower dtype named, or "int8" as qgZ
    exchanges it (`_exchange`, in `jax.shard_map`; reduced in float32 where no dimension of the
    parameter's shard divides into one chunk per replica). Returns float32."""
    if fmt != "int8":
        return jnp.sum(acc.astype(fmt), axis=0).astype(jnp.float32)
    n = acc.shape[0]
    spec = tuple(sharding.spec) + (None,) * (acc.ndim - 1 - len(sharding.spec))

    def local(x):
        part = x[0].astype(jnp.float32)
        dim = gradient_chunks(part.shape, ((),) * part.ndim, n)  # the shard's own dims: none split further
        return jax.lax.psum(part, axes) if dim is None else _exchange(part, dim, n, axes, False)

    fn = jax.shard_map(local, mesh=sharding.mesh, in_specs=jax.sharding.PartitionSpec(axes, *spec),
                       out_specs=jax.sharding.PartitionSpec(*spec), check_vma=False)
    return fn(acc)


def scatter_replicas(acc: jax.Array, fmt: str, sharding: jax.sharding.NamedSharding,
                     target: jax.sharding.NamedSharding, axes: tuple[str, ...]) -> jax.Array:
    """`reduce_replicas` into `target`: the parameter's sharding (`sharding`) with some of the
    replicas' `axes` added to one dimension (`core.sharding.optimizer_spec`, the sharded-optimizer
    layout): one reduce-scatter along it (`jax.lax.psum_scatter`) in `fmt`, where an all-reduce
    would leave every replica the whole sum. An int8 exchange (qgZ's, `_exchange`) is reduced
    whole and then sliced. Returns float32."""
    if fmt == "int8":
        return jax.lax.with_sharding_constraint(reduce_replicas(acc, fmt, sharding, axes), target)
    ndim = acc.ndim - 1
    src = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    dst = tuple(target.spec) + (None,) * (ndim - len(target.spec))

    def names(d) -> tuple[str, ...]:
        return () if d is None else (d,) if isinstance(d, str) else tuple(d)

    (dim,) = [d for d in range(ndim) if names(src[d]) != names(dst[d])]
    added = names(dst[dim])[len(names(src[dim])):]
    if set(added) != {a for a in axes if sharding.mesh.shape[a] > 1}:  # not one scatter over every replica axis
        return jax.lax.with_sharding_constraint(reduce_replicas(acc, fmt, sharding, axes), target)

    def local(x):
        part = x[0].astype(fmt)
        return jax.lax.psum_scatter(part, added, scatter_dimension=dim, tiled=True).astype(jnp.float32)

    fn = jax.shard_map(local, mesh=sharding.mesh, in_specs=jax.sharding.PartitionSpec(axes, *src),
                       out_specs=jax.sharding.PartitionSpec(*dst), check_vma=False)
    return fn(acc)
