"""Stages that run the same program take one intra-op plan.

A pipeline of repeated layers cuts into stages that are, op for op, the same program: GPT-39B in 8
stages on Alpa's testbed has six stages of six blocks each, whose forward + backward programs differ
only in their layers' names. Planned with the same pins, on the same mesh, with the same options,
the intra-op ILP sees the same problem in each (the names it reads, the module paths of layer
sharing and kernel recognition, are compared with their layer indices masked here), so the plan of
the first stage is the plan of the others, up to the names it records: `relabelled` gives it the
other stage's argument paths, output paths and op labels. Solving each again cost ~1 s a stage.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from planner.core.plan import Plan
from planner.graph.ir import Graph, Literal

_INDEX = re.compile(r"\d+")


def program_key(graph: Graph) -> str:
    """A fingerprint of `graph` as the intra-op ILP reads it: tensors (shapes, dtypes), inputs and
    outputs, every op (primitive, parameters, operands, results, module path with its numbers
    masked), constants and the graph's annotations. Equal keys: the same program, names aside."""
    h = hashlib.sha1()

    def value(v: Any) -> Any:
        a = np.asarray(v)
        return (a.dtype.str, a.shape, a.tobytes()) if a.dtype != object else repr(v)

    def operand(x: Any) -> Any:
        return ("lit", value(x.value), x.tensor.shape, str(x.tensor.dtype)) if isinstance(x, Literal) else x

    h.update(repr([(t.shape, str(t.dtype)) for t in graph.tensors]).encode())
    h.update(repr((graph.inputs, [operand(x) for x in graph.outputs], graph.user_constraints, graph.loop_ties,
                   graph.update_groups, sorted((k, repr(v)) for k, v in graph.regions.items()),
                   sorted((k, repr(v)) for k, v in graph.recompute.items()),
                   sorted((k, value(v)) for k, v in graph.consts.items()))).encode())
    for op in graph.ops:
        h.update(repr((op.name, _INDEX.sub("#", op.name_stack), sorted((k, repr(v)) for k, v in op.params.items()),
                       [operand(x) for x in op.inputs], op.outputs)).encode())
    return h.hexdigest()


def _labels(planned: Graph, graph: Graph) -> tuple[dict[str, str], set[str]] | None:
    """The node labels of `planned`'s problem mapped to `graph`'s (`ilp.problem`: "input PATH", or an
    op's name and module path), and the names of `planned` that `graph` calls otherwise; None when a
    label would map to two."""
    labels: dict[str, str] = {}
    differing: set[str] = set()
    pairs = [(f"input {a}", f"input {b}", a, b) for a, b in zip(planned.input_paths, graph.input_paths)]
    pairs += [(f"{a.name} {a.name_stack}".strip(), f"{b.name} {b.name_stack}".strip(), a.name_stack, b.name_stack)
              for a, b in zip(planned.ops, graph.ops)]
    for la, lb, na, nb in pairs:
        if labels.setdefault(la, lb) != lb:
            return None
        if na != nb and na:
            differing.add(na)
    return labels, differing


def relabelled(plan: Plan, planned: Graph, graph: Graph) -> Plan | None:
    """`plan`, made for the program `planned`, as the plan of `graph` (the same program by
    `program_key`): its paths and trees `graph`'s, its decisions' labels and its collectives' ops
    renamed. None where a name it records cannot be renamed with certainty (free text naming a
    layer of `planned`: a fused kernel's line, a user constraint, a lever): plan `graph` itself."""
    if plan.kernels or plan.user_constraints or plan.levers.remat or plan.levers.offload \
            or plan.levers.accumulation or plan.stages:
        return None
    found = _labels(planned, graph)
    if found is None:
        return None
    labels, differing = found

    def free_text(text: str) -> bool:  # names no layer of `planned` that `graph` calls otherwise
        return not any(name in text for name in differing)

    def label(text: str) -> str | None:
        return labels.get(text, text if free_text(text) else None)

    decisions = []
    for d in plan.decisions:
        new = label(d.label)
        if new is None or not (free_text(d.chosen) and free_text(d.runner_up)):
            return None
        decisions.append(dataclasses.replace(d, label=new))
    collectives = []
    for c in plan.prediction.collectives:
        new = label(c.where)
        if new is None:
            return None
        collectives.append(dataclasses.replace(c, where=new))
    prediction = dataclasses.replace(plan.prediction, collectives=tuple(collectives))
    return dataclasses.replace(plan, input_paths=graph.input_paths, output_paths=graph.output_paths, in_tree=graph.in_tree,
                    out_tree=graph.out_tree, decisions=tuple(decisions), prediction=prediction)


def reuse_key(graph: Graph, mesh: Any, pins: Mapping[int, Any], options: Any) -> tuple | None:
    """What must be equal for two stages to take one plan: the program, the mesh, the pinned input
    layouts and the options (None when one of them cannot be compared by hash)."""
    key = (program_key(graph), mesh, tuple(sorted(pins.items())), options)
    try:
        hash(key)
    except TypeError:
        return None
    return key
