"""Shape buckets: `plan_parallel(..., shapes="bucketed")` plans a step once per bucket of batch
sizes and runs every other size of the bucket with that plan, recompiled for its shapes.

A bucket is the powers-of-two interval a batch size falls in ((2^(k-1), 2^k]: 33..64 is the bucket
64), read from the leading dimension of the batch argument's leaves (the last positional argument,
as the pipeline and accumulation levers read it). The cache key of a bucketed step is its arguments'
signature with those dimensions replaced by their bucket (`bucket_key`); the plan made for the first
size of a bucket serves a later size when `reuse_problem` finds nothing against it:

- the step traces to the same program at the new size (the same ops in the same order, only tensor
  shapes differ: a step that branches on its batch size in Python is re-planned);
- every sharding the plan sets (arguments, results, intermediates) divides the new shapes;
- the plan is one program on one mesh without a lever that rewrote its graph (pipeline stages,
  gradient accumulation, recomputation, a streamed optimizer update re-plan per size).

Otherwise the size is planned on its own (and becomes its bucket's plan). The plan's predictions are
those of the size it was made for.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from planner.core.plan import Plan
from planner.core.sharding import Spec
from planner.graph.ir import Graph

SHAPE_MODES = ("exact", "bucketed")


def bucket(size: int) -> int:
    """The bucket of a batch size: the smallest power of two at least `size`."""
    return 1 << max(0, int(size) - 1).bit_length()


def bucket_key(signature: tuple, args: tuple[Any, ...]) -> tuple:
    """`signature` (the arguments' abstract signature, `api._signature`: (treedef, ((shape, dtype),
    ...)) or that and the static leaves' key) with the leading dimension of every leaf of the last
    positional argument replaced by its bucket."""
    arrays, rest = (signature[0], signature[1:]) if isinstance(signature[0], tuple) else (signature, ())
    tree, leaves = arrays
    n_batch = len(jax.tree_util.tree_leaves(args[-1])) if args else 0
    first = len(leaves) - n_batch
    out = tuple((_bucketed(shape) if i >= first else shape, dtype) for i, (shape, dtype) in enumerate(leaves))
    return ((tree, out), *rest)


def _bucketed(shape: tuple) -> tuple:
    return (bucket(shape[0]),) + tuple(shape[1:]) if shape else shape


def reuse_problem(plan: Plan, planned: Graph, graph: Graph) -> str | None:
    """Why `plan` (made for the graph `planned`) cannot run the program `graph` of the same step at
    another batch size; None when it can (see the module docstring)."""
    remat, offload = plan.levers.remat, plan.levers.offload
    if plan.stages or plan.levers.accumulation is not None or (remat is not None and (remat.layers or remat.scans)) \
            or (offload is not None and offload.streamed):
        return "the plan uses a lever that rewrote its program (pipeline, accumulation, recomputation, streaming)"
    if graph.recompute or graph.update_groups or len(planned.ops) != len(graph.ops) \
            or len(planned.tensors) != len(graph.tensors) or planned.inputs != graph.inputs \
            or any(a.name != b.name or a.outputs != b.outputs for a, b in zip(planned.ops, graph.ops)):
        return "the step traces to another program at this size"
    sizes = plan.mesh.shape
    checks: list[tuple[Sequence[int], Spec]] = list(zip((graph.tensors[t].shape for t in graph.inputs),
                                                        plan.input_specs))
    checks += [(graph.tensors[t].shape, s) for t, s in zip(graph.outputs, plan.output_specs)
               if isinstance(t, int) and s is not None]
    checks += [(graph.tensors[graph.ops[i].outputs[k]].shape, s) for i, k, s in (*plan.op_specs, *plan.scatter_specs)]
    checks += [(_operand_shape(graph, i, k), s) for i, k, s in plan.operand_specs]
    for shape, spec in checks:
        for d, axes in enumerate(spec):
            ways = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if d < len(shape) and shape[d] % ways:
                return f"a sharding splits a dimension of size {shape[d]} {ways} ways"
    return None


def _operand_shape(graph: Graph, op: int, k: int) -> tuple[int, ...]:
    x = graph.ops[op].inputs[k]
    return graph.tensors[x].shape if isinstance(x, int) else x.tensor.shape
