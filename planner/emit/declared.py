"""Kernels whose parallel dimensions the user declares: `planner.register_kernel`.

    attention = planner.register_kernel(
        my_flash_attention,                                  # (q, k, v) -> o, a Pallas kernel
        in_axes=(("batch", None, "heads", None),) * 3,       # q, k, v: [batch, seq, heads, head_dim]
        out_axes=("batch", None, "heads", None),
        flops=lambda q, k, v: 4 * q[0] * q[1] * k[1] * q[2] * q[3])
    o = attention(q, k, v)                                   # in the train step, as before

An axis name shared by operand and result dimensions is a dimension the kernel computes each slice
of independently: the planner may split it over any mesh axes (`ilp.kernel_rules`); None keeps a
dimension whole. A name that some result lacks is kept whole too (the kernel sums or mixes along
it). The wrapped function is a `jax.experimental.custom_partitioning` call whose sharding rule is
the declaration, so XLA runs `fn` itself on each device's shard, and the planner reads the rule
from the traced program: nothing is registered in the process, and the declaration travels with
the step (the pipeline's stage programs, recomputation and accumulation trace it again as it is).

Its derivative is `jax.vjp` of `fn` (a kernel with a `custom_vjp` brings its own backward kernels),
wrapped the same way: operands (the inputs, the result cotangents) and results (the input
cotangents) carry the declared names, so it is split along the names in every input.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from planner.core.errors import InvalidArgumentError

Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class _Partition:
    """The partition callback of one declared call (`custom_partitioning.def_partition`): each
    operand and result split along the declared names the results share, as the results' shardings
    (the planner's constraints) split them. `name` and `flops` are read back by the planner's rule."""

    fn: Callable[..., Any]
    operands: tuple[Axes, ...]
    results: tuple[Axes, ...]
    name: str
    flops: Any = None

    def shared(self) -> set[str]:
        return set.intersection(*(set(a for a in axes if a is not None) for axes in self.results))

    def __call__(self, mesh, arg_shapes, result_shape):
        results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        shared = self.shared()
        axes_of = _split_names(self.results, results, shared)

        def sharding(axes: Axes) -> NamedSharding:
            return NamedSharding(mesh, PartitionSpec(*(axes_of.get(a) if a in shared else None for a in axes)))

        outs = tuple(sharding(a) for a in self.results)
        return mesh, self.fn, outs if isinstance(result_shape, (tuple, list)) else outs[0], \
            tuple(sharding(a) for a in self.operands)


def _split_names(declared: Sequence[Axes], shapes: Sequence[Any], shared: set[str]) -> dict[str, Any]:
    """Declared name -> the mesh axes the first of `shapes` (values with a `.sharding`) holding it
    splits it over, for the names in `shared`."""
    axes_of: dict[str, Any] = {}
    for axes, value in zip(declared, shapes):
        spec = tuple(value.sharding.spec) + (None,) * (len(axes) - len(value.sharding.spec))
        for name, part in zip(axes, spec):
            if name in shared and part is not None:
                axes_of.setdefault(name, part)
    return axes_of


def _rule(operands: Sequence[Axes], results: Sequence[Axes]) -> SdyShardingRule:
    """The declaration as a Shardy rule: named dimensions by name, whole ones each a factor of its
    own that needs replication."""
    whole: list[str] = []

    def factors(axes: Axes) -> tuple[str, ...]:
        out = []
        for a in axes:
            if a is None:
                whole.append(f"whole{len(whole)}")
                out.append(whole[-1])
            else:
                out.append(a)
        return tuple(out)

    ops, res = tuple(factors(a) for a in operands), tuple(factors(a) for a in results)
    return SdyShardingRule(ops, res, need_replication_factors=tuple(whole))


def _partitioned(fn: Callable[..., Any], operands: tuple[Axes, ...], results: tuple[Axes, ...], name: str,
                 flops: Any, single: bool) -> Callable[..., Any]:
    def flat(*xs):
        out = fn(*xs)
        return out if single else tuple(out)

    call = custom_partitioning(flat)
    partition = _Partition(flat, operands, results, name, flops)
    call.def_partition(partition=partition, sharding_rule=_rule(operands, results),
                       infer_sharding_from_operands=lambda mesh, args, result_shape: _infer(partition, mesh, args,
                                                                                              result_shape))
    return call


def _infer(partition: _Partition, mesh, arg_shapes, result_shape):
    """The results' shardings from the operands' (GSPMD's propagation through the call): each
    shared name split as the first operand holding it is."""
    axes_of = _split_names(partition.operands, arg_shapes, partition.shared())
    outs = tuple(NamedSharding(mesh, PartitionSpec(*(axes_of.get(x) for x in axes))) for axes in partition.results)
    return outs if isinstance(result_shape, (tuple, list)) else outs[0]


def _axes(value: Any, what: str) -> Axes:
    if not isinstance(value, (tuple, list)) or not all(a is None or isinstance(a, str) for a in value):
        raise InvalidArgumentError(f"register_kernel: {what}={value!r} must be a tuple of axis names (str) or "
                                   "None, one per dimension")
    return tuple(value)


def register_kernel(fn: Callable[..., Any], *, in_axes: Sequence[Sequence[str | None]],
                    out_axes: Sequence[str | None] | Sequence[Sequence[str | None]],
                    flops: float | Callable[..., float] | None = None, name: str | None = None) -> Callable[..., Any]:
    """`fn` (a function of arrays returning an array or a tuple of arrays, typically a Pallas kernel
    call) with its parallel dimensions declared for the planner (module docstring).

    Args:
      fn: the kernel; called with positional array arguments.
      in_axes: per operand, one axis name or None per dimension.
      out_axes: per result likewise (one tuple for a single result).
      flops: the kernel's FLOPs, or a function of the operands' shapes giving them (the planner
        prices the call with them; default: the matmuls of `fn`'s jaxpr).
      name: what warnings and plans call it (default: `fn`'s name).

    Returns:
      A function with `fn`'s signature, differentiable, that the planner shards and prices as declared.
    """
    operands = tuple(_axes(a, "in_axes entry") for a in in_axes)
    single = bool(out_axes) and all(a is None or isinstance(a, str) for a in out_axes)
    results = (_axes(out_axes, "out_axes"),) if single else tuple(_axes(a, "out_axes entry") for a in out_axes)
    label = name or getattr(fn, "__name__", "kernel")
    forward = _partitioned(fn, operands, results, label, flops, single)

    def backward_fn(*args):
        primals, cts = args[:len(operands)], args[len(operands):]
        _, vjp = jax.vjp(fn, *primals)
        return tuple(vjp(cts[0] if single else tuple(cts)))

    backward = _partitioned(backward_fn, operands + results, operands, f"{label} (backward)", None, False)

    @jax.custom_vjp
    def kernel(*args):
        _check(args, operands, label)
        return forward(*args)

    def kernel_fwd(*args):
        _check(args, operands, label)
        return forward(*args), args

    def kernel_bwd(args, ct):
        return backward(*args, *((ct,) if single else tuple(ct)))

    kernel.defvjp(kernel_fwd, kernel_bwd)
    return kernel


def _check(args: Sequence[Any], operands: Sequence[Axes], label: str) -> None:
    if len(args) != len(operands):
        raise InvalidArgumentError(f"register_kernel({label}): called with {len(args)} operands, declared {len(operands)}")
    for k, (x, axes) in enumerate(zip(args, operands)):
        if len(jax.numpy.shape(x)) != len(axes):
            raise InvalidArgumentError(f"register_kernel({label}): operand {k} has rank {len(jax.numpy.shape(x))}, "
                                       f"declared {len(axes)} axes {axes}")
