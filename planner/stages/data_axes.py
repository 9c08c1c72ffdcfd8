"""The data axes of a layer's plan: the mesh axes splitting its batch, over which the pipeline
runtime reduces the gradients once per step (`layer_cost`'s module docstring), what that reduction
costs (`grad_sync`, `replica_quantisation`), and which axes no plan can make data axes
(`never_data`)."""
from __future__ import annotations

from collections.abc import Sequence

from planner.core.sharding import Spec
from planner.graph.ir import Graph
from planner.ilp.strategies import int8_reduction
from planner.ilp.wire import before_reduction


def never_data(graph: Graph, ext: Sequence[int], params: Sequence[int], mesh) -> frozenset[int]:
    """The mesh axes no plan of the layer can make data axes (`batch_axes`): no input of the layer but
    its parameters has a dim 0 the axis divides (a strategy splits a dimension only evenly, so
    microbatches of fewer rows than the axis's size cannot be split over it). The price charges an
    all-reduce over such an axis every microbatch (`grad_sync` defers only those over data axes), so
    the step-weighted solve keeps it whole (`make_plan(whole_axes=)`): weighed down it made the solve
    choose plans whose price was up to ~9x its objective, then solve the layer again for one
    microbatch (`_cheaper_step`; GPT-39B at one row per microbatch on 8x8 V100: 11 of 11 such layers)."""
    param_set = set(params)
    heads = [graph.tensors[t].shape[0] for t in ext if t not in param_set and graph.tensors[t].shape]
    return frozenset(a for a, n in enumerate(mesh.shape) if n > 1 and not any(h % n == 0 for h in heads))


def batch_axes(specs: Sequence[Spec | None], mesh) -> frozenset[str]:
    """Names of the mesh axes splitting dim 0 (the batch) of any of `specs` (the layer's inputs
    other than parameters: activations and batch leaves)."""
    return frozenset(mesh.axis_names[a] for spec in specs if spec for a in spec[0] if mesh.shape[a] > 1)


def replica_quantisation(sub: Graph, plan, data_axes: frozenset[str], cost) -> float:
    """The quantisation time (`ilp.strategies.int8_reduction`) of the plan's int8 gradient
    exchanges over data axes only, which the ILP charges per microbatch: the pipeline runtime
    quantises each replica's accumulated gradient once per step (`emit.wire.reduce_replicas`)."""
    names = cost.mesh.axis_names
    specs = {(i, k): spec for i, k, spec in plan.op_specs}
    total = 0.0
    for w in plan.wire:
        out = specs.get((w.op, 0))
        if w.kind != "reduce" or out is None or not {names[a] for a in w.axes} <= data_axes:
            continue
        pre, scatter = before_reduction(out, w.axes)
        kind = "all-reduce" if scatter is None else "reduce-scatter"
        total += int8_reduction(kind, sub.tensors[sub.ops[w.op].outputs[0]], pre, w.axes, cost)[1]
    return total


def grad_sync(prediction, data_axes: frozenset[str], cost) -> tuple[float, float]:
    """(its time, the part of it exposed in `prediction.step_time_s`) of the data-parallel gradient
    reduction of a plan (see the module docstring): the "partial sum" collectives over data axes only,
    priced combined as the ILP prices them."""
    axes_of = {n: i for i, n in enumerate(cost.mesh.axis_names)}
    groups: set[tuple[str, tuple[int, ...]]] = set()
    total = 0.0
    for c in prediction.collectives:
        if c.reason != "partial sum" or not c.axes or not set(c.axes) <= data_axes:
            continue
        axes = tuple(sorted(axes_of[a] for a in c.axes))
        total += cost.collective_time(c.kind, c.nbytes, axes, True)
        groups.add((c.kind, axes))
    total += sum(cost.collective_latency(kind, axes) for kind, axes in groups)
    hidden = float(getattr(prediction, "hidden_communication_time_s", 0.0) or 0.0)
    exposed = min(max(0.0, total - hidden), max(0.0, prediction.step_time_s - prediction.compute_time_s))
    return total, exposed
