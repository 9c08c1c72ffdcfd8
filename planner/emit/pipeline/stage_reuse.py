"""Stages whose ops are the same program take one trace.

A pipeline of repeated layers cuts into stages that are, op for op, the same program (GPT-39B in 13
stages on Alpa's testbed: eleven stages of three blocks each). Tracing a stage's forward +
backward (`programs.stage_graph`, `jax.vjp` over its ops bound one by one) costs ~0.5 s per stage
of three GPT-39B blocks; the traces of such stages differ only in the module paths their ops were
bound under (`blocks_3/...` against `blocks_6/...`). `StageGraphs` traces the first stage of each
program and gives the others its trace with their own names (`renamed`): each path component of
the earlier stage's ops (`blocks_3`) replaced by the one at the same place in this stage's
(`blocks_6`), where that correspondence is one to one over every op and control-flow region of
the two ranges; otherwise, and for a program whose key cannot be made, the stage is traced.

Two ranges are the same program (`source_key`) when, op for op, their primitives, parameters,
module paths with numbers masked, operand structure (the stage's inputs by group and position,
earlier ops' results by place, literals and captured constants by value), result types, and their
control-flow regions and recomputation groups (by place) are equal, as are the types of the
stage's inputs and which values it returns. The traced program is then the same up to those
names: tracing is deterministic in the ops bound (tested against a trace of each stage).

Given a store that outlives one call (`PlanningMemo.stage_traces`: a sweep's batch sizes), the
stages of another cut at the same microbatch size take these traces too, and so does the loss
traced at that size, which the stages are cut from (`loss_graph`; GPT-39B: ~2 s).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from planner.emit.pipeline.programs import StageGraph, stage_graph
from planner.graph.ir import Graph, Literal
from planner.graph.trace import trace

_INDEX = re.compile(r"\d+")
_TOKEN = re.compile(r"[^/()]+")


def _value(v: Any) -> Any:
    a = np.asarray(v)
    if a.dtype == object:
        return repr(v)
    return (a.dtype.str, a.shape, hashlib.sha1(a.tobytes()).hexdigest())


def _params(params) -> str:
    return repr(sorted((k, repr(v)) for k, v in params.items()))


def source_key(graph: Graph, ops: Sequence[int], groups: Sequence[Sequence[int]],
               outs: Sequence[Sequence[int]]) -> tuple | None:
    """What must be equal for two stages' traces to be one program up to names (module
    docstring): `ops` of `graph` run on the input `groups` (tensor ids per group), returning the
    tensors of `outs` (per group). None where a range reads a value from outside its groups that is
    not a captured constant (it is traced itself)."""
    rel: dict[int, tuple] = {}
    sig: list[Any] = []
    for g, group in enumerate(groups):
        for p, t in enumerate(group):
            rel.setdefault(t, ("in", g, p))
        sig.append(tuple((graph.tensors[t].shape, str(graph.tensors[t].dtype)) for t in group))
    place = {i: k for k, i in enumerate(ops)}

    def operand(x: Any) -> Any:
        if isinstance(x, Literal):
            return ("lit", _value(x.value), x.tensor.shape, str(x.tensor.dtype))
        if x in rel:
            return rel[x]
        if x in graph.consts:
            return ("const", _value(graph.consts[x]))
        raise KeyError(x)

    try:
        for k, i in enumerate(ops):
            op = graph.ops[i]
            sig.append((op.name, _INDEX.sub("#", op.name_stack), _params(op.params),
                        tuple(operand(x) for x in op.inputs),
                        tuple((graph.tensors[t].shape, str(graph.tensors[t].dtype)) for t in op.outputs)))
            for j, t in enumerate(op.outputs):
                rel[t] = ("op", k, j)
        for start, regions in graph.regions.items():
            for r in regions:
                inside = [place.get(i) for i in range(r.start, r.end)]
                if all(p is None for p in inside):
                    continue
                if any(p is None for p in inside) or r.start not in place:
                    return None  # a region crossing the stage's ends: not compared, traced
                sig.append(("region", r.kind, place[r.start], len(inside), _params(r.params),
                            _INDEX.sub("#", r.name_stack), tuple(operand(x) for x in r.operands),
                            tuple(operand(x) for x in r.outputs)))
        for start, group in graph.recompute.items():
            if start in place:
                sig.append(("recompute", place[start], group.end - group.start,
                            tuple(operand(t) for t in group.inputs), operand(group.gate)))
        sig.append(tuple(tuple(operand(t) for t in group) for group in outs))
    except KeyError:
        return None
    return tuple(sig)


def _names(graph: Graph, ops: Sequence[int]) -> list[str]:
    """The module paths of `ops` and of the regions starting among them, in order."""
    opset = set(ops)
    found = [graph.ops[i].name_stack for i in ops]
    for start in sorted(graph.regions):
        if start in opset:
            found += [r.name_stack for r in graph.regions[start]]
    return found


def name_map(earlier: list[str], later: list[str]) -> dict[str, str] | None:
    """Path component -> path component taking the module paths `earlier` to `later` place by
    place, only the components that differ; None where that is not one to one (a component that
    would become two, or two that would become one) or the paths do not pair up."""
    if len(earlier) != len(later):
        return None
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}
    for a, b in zip(earlier, later):
        ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
        if len(ta) != len(tb):
            return None
        for x, y in zip(ta, tb):
            if forward.setdefault(x, y) != y or backward.setdefault(y, x) != x:
                return None
    return {x: y for x, y in forward.items() if x != y}


def renamed(sg: StageGraph, names: dict[str, str]) -> StageGraph:
    """`sg` with each path component of its ops' and regions' module paths renamed by `names`."""
    if not names:
        return sg

    def rename(path: str) -> str:
        return _TOKEN.sub(lambda m: names.get(m.group(0), m.group(0)), path) if path else path

    g = sg.graph
    ops = tuple(dataclasses.replace(op, name_stack=rename(op.name_stack)) for op in g.ops)
    regions = {k: tuple(dataclasses.replace(r, name_stack=rename(r.name_stack)) for r in rs)
               for k, rs in g.regions.items()}
    source = None if g.source is None else dataclasses.replace(g.source, ops=ops)
    graph = dataclasses.replace(g, ops=ops, regions=regions, source=source)
    return dataclasses.replace(sg, graph=graph)


class StageGraphs:
    """Stage traces: `get` traces a stage unless an earlier one was the same program (module
    docstring). `made`: the traces by program, to share beyond one `stage_records` call (a sweep's
    `PlanningMemo.stage_traces`). `traced` / `reused`: how many of each this object gave."""

    def __init__(self, made: dict | None = None) -> None:
        self._made: dict[tuple, Any] = made if made is not None else {}
        self.traced = 0
        self.reused = 0

    def loss_graph(self, loss_fn: Any, params: Any, microbatch: Any) -> Graph:
        """`loss_fn` traced on the abstract `params` and `microbatch`, or the trace of an earlier
        call at the same argument types held in the shared store (one step function's: a
        `PlanningMemo` is cleared for another, `search_space`)."""
        leaves, tree = jax.tree_util.tree_flatten((params, microbatch))
        key = ("loss", str(tree), tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if key not in self._made:
            self._made[key] = trace(loss_fn, params, microbatch)
        return self._made[key]

    def get(self, graph: Graph, ops: tuple[int, ...], param_ids: tuple[int, ...], acts_in: tuple[int, ...],
            aux_in: tuple[int, ...], batch_ids: tuple[int, ...], outs: tuple[int, ...],
            aux_out: tuple[int, ...]) -> StageGraph:
        """`programs.stage_graph(graph, ops, ...)`, or an earlier stage's trace renamed."""
        key = source_key(graph, ops, (param_ids, acts_in, aux_in, batch_ids), (outs, aux_out))
        names = _names(graph, ops)
        if key is not None and key in self._made:
            earlier, sg = self._made[key]
            mapping = name_map(earlier, names)
            if mapping is not None:
                self.reused += 1
                return renamed(sg, mapping)
        sg = stage_graph(graph, ops, param_ids, acts_in, aux_in, batch_ids, outs, aux_out)
        self.traced += 1
        if key is not None:
            self._made.setdefault(key, (names, sg))
        return sg
