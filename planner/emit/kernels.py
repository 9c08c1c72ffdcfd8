"""Emitting fused kernels on their shards: a `pallas_call` the plan splits along the grid axes it
is independent along (`ilp.kernel_rules`) runs inside `jax.shard_map`, once per device, on the
device's blocks, with its grid shrunk to them (`core.compat.pallas_call_on_shard`).

Without this, XLA would see the kernel as one custom call it cannot partition and gather every
operand to run it whole on every device. Kernels declared with `planner.register_kernel` need
nothing here: their `custom_partitioning` call runs the user's function on each shard itself.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from planner.core.compat import bind, pallas_call_on_shard
from planner.core.plan import Plan
from planner.core.sharding import Spec, to_partition_spec
from planner.graph.ir import Graph, Op
from planner.ilp.rules import signature

ApplyOp = Callable[[Op, list[Any]], "list[Any] | None"]


def kernel_hook(plan: Plan, mesh: jax.sharding.Mesh, graph: Graph) -> ApplyOp | None:
    """The `apply_op` hook of `Graph.evaluate` that runs each split Pallas kernel of `graph` on its
    shards (module docstring); None when the graph has no Pallas kernel."""
    kernels = {op.index for op in graph.ops if op.name == "pallas_call"}
    if not kernels:
        return None
    specs = {(op, k): spec for op, k, spec in plan.op_specs if op in kernels}

    def apply(op: Op, operands: list[Any]) -> list[Any] | None:
        if op.index not in kernels:
            return None
        placed = on_shards(op, graph, [specs.get((op.index, k)) for k in range(len(op.outputs))], plan, mesh)
        return None if placed is None else placed(*operands)

    return apply


def on_shards(op: Op, graph: Graph, out_specs: list[Spec | None], plan: Plan,
              mesh: jax.sharding.Mesh) -> Callable[..., list[Any]] | None:
    """The kernel `op` as a function of its (global) operands running on the shards its planned
    result specs `out_specs` give it; None when the plan splits none of its dimensions."""
    sig = signature(op, graph)
    if not sig.known or any(s is None for s in out_specs):
        return None
    axes_of: dict[str, tuple[int, ...]] = {}
    for labels, spec in zip(sig.outputs, out_specs):
        for label, axes in zip(labels, spec):
            if label is not None and axes:
                axes_of.setdefault(label, tuple(axes))
    if not axes_of:
        return None
    splits = {int(label[1:]): plan.mesh.axis_size(axes) for label, axes in axes_of.items()}
    local = pallas_call_on_shard(op.params, splits)

    def spec_of(labels) -> PartitionSpec:
        if labels is None:
            return PartitionSpec()
        return to_partition_spec(tuple(axes_of.get(l, ()) if l is not None else () for l in labels), plan.mesh)

    fn = jax.shard_map(lambda *xs: tuple(bind(op.primitive, local, xs)), mesh=mesh,
                       in_specs=tuple(spec_of(l) for l in sig.inputs),
                       out_specs=tuple(spec_of(l) for l in sig.outputs), check_vma=False)
    return lambda *operands: list(fn(*operands))
