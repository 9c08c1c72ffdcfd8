"""Lower bounds on the per-device peak every plan keeps live: before the ILP is built
(`memory_floor`), over a mesh's device count (`liveness_floor`), per program point of one problem
(`memory_lower_bound`), and the strategies they rule out under a budget (`over_budget_strategies`)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

import numpy as np

from planner.core.sharding import num_shards
from planner.graph.ir import Graph
from planner.ilp.liveness import (
    _combined_point,
    _copied_only_if_resharded,
    _materialised,
    _reduction_buffers,
    _transient_point,
    _unfit_buffers,
    _xla_cpu,
)
from planner.ilp.problem import Problem


def memory_floor(graph: Graph, num_devices: int, donated: frozenset[int] = frozenset()) -> int:
    """Bytes per device every plan on `num_devices` devices keeps live at the end of the step,
    known before any ILP is built: each argument, and each output computed from the arguments, at
    `nbytes // num_devices`. `memory_profile` counts them there, each in its planned layout: an
    argument is decided and lives for the whole program, such an output is decided, written and
    lives to the end (`live_ranges.live_ranges`), and no layout splits a tensor more than `num_devices`
    ways. Below `memory_lower_bound` of every mesh of that size (it needs the built ILP); without
    host offload, which moves arguments off the device (the mesh search uses it only then). Donated
    arguments (`donated`, input tensor ids) are left out: their buffers may hold outputs by then."""
    derived = set(graph.inputs)
    for op in graph.ops:
        if any(isinstance(x, int) and x in derived for x in op.inputs):
            derived.update(op.outputs)
    ends = (set(graph.inputs) - donated) | {t for t in graph.outputs if isinstance(t, int) and t in derived}
    return sum(graph.tensors[t].nbytes // num_devices for t in ends)


def liveness_floor(problem: Problem, kept_away: Collection[int] = ()) -> int:
    """Bytes per device every plan keeps live at the fullest program point, on any mesh of
    `problem`'s device count: `memory_profile`'s tensor terms (each value the plan materialises,
    over its live range) with every value split over every device (`nbytes // devices`, which no
    layout goes below), its operand copies and reduction buffers left out (they only add).

    The values and live ranges that term counts come from the graph, the platform's fusions and
    the donated arguments, not from the mesh's shape (`build_problem`), so after one mesh's ILP is
    built this bounds every mesh of that size before theirs are (`search.meshes.search_meshes`); it is
    below each one's `memory_lower_bound` (tests/test_search_pruning.py). With host offload,
    `kept_away`: every value some offload choice may keep on the host (the offloadable arguments
    and their new values, `offload.offloadable_pairs`), left out; offload moves no other value's
    live range (`live_ranges.offloaded_live_ranges`), and what it copies in is a copy (left out)."""
    n = len(problem.graph.ops)
    devices = problem.cost.mesh.size
    away = set(kept_away)
    delta = np.zeros(n + 3, dtype=np.int64)
    for tid, (first, last) in problem.decided_live():
        if tid not in away and _materialised(problem, tid, first):
            b = problem.graph.tensors[tid].nbytes // devices
            delta[first + 1] += b
            delta[last + 2] -= b
    return int(np.cumsum(delta).max())


def memory_lower_bound(problem: Problem) -> np.ndarray:
    """Per program point, bytes per device that every plan the planner can choose keeps live there.

    The terms of `memory_profile` grouped by the decision that sets them (as the ILP's
    `memory_constraints.memory_expr` groups them into one coefficient per decision and strategy), each group at
    its least over that decision's strategies, point by point: the tensors a decision owns (every
    layer sharing it counted), the operand copies its consumers read in its layout, its XLA:CPU
    reduction buffers. A copy that exists only when resharded counts at its consumer's smallest
    layout, or not at all where some layout pair needs none. A decision takes one strategy in every
    plan, so each group of `memory_profile(problem, choice)` is at least its least here, point by
    point, for every `choice`: `max()` is a sound lower bound on the planner's peak under sharding
    alone, for any choice, ties held or not (tests/test_infeasible.py checks it against plans and
    random choices). Grouping by decision counts that one strategy cannot make every value small at
    once (on XLA:CPU, a strategy that splits a tensor may reduce partial sums the others do not),
    which raises the bound over each term at its own smallest there.
    """
    found = problem._bounds.get("memory")
    if found is None:
        found = problem._bounds["memory"] = _memory_lower_bound(problem)
    return found.copy()


def _bound_parts(problem: Problem) -> tuple[dict, np.ndarray, int]:
    """The terms of `memory_lower_bound`: per representative decision, its (bytes per strategy,
    first point, point after the last) spans; the per-point steps of the terms no decision sets
    (copies that exist only when resharded, at their least); and XLA:CPU's reserved bytes. Computed
    once per problem (the bound and `over_budget_strategies` both read them; treat as read-only)."""
    found = problem._bounds.get("parts")
    if found is None:
        found = problem._bounds["parts"] = _compute_bound_parts(problem)
    return found


def _compute_bound_parts(problem: Problem) -> tuple[dict, np.ndarray, int]:
    n = len(problem.graph.ops)
    mesh = problem.cost.mesh
    rep = problem.rep
    tensors = problem.graph.tensors
    cpu = _xla_cpu(problem)
    shards: dict = {}  # spec -> devices it splits a tensor over (few distinct specs, many tensors)
    whole: dict = {}  # tensor id -> its bytes

    def nbytes(tid: int, spec) -> int:  # `shard_bytes`
        n = shards.get(spec)
        if n is None:
            n = shards[spec] = num_shards(spec, mesh)
        b = whole.get(tid)
        if b is None:
            b = whole[tid] = tensors[tid].nbytes
        return b // n

    # per decision: (bytes per strategy, first point, point after the last) spans, and its reserved bytes
    spans: dict[int, list[tuple[np.ndarray, int, int]]] = defaultdict(list)
    reserved_of: dict[int, np.ndarray] = {}
    def owned(tid: int) -> np.ndarray:  # the tensor's bytes under each strategy of its decision
        return np.array([nbytes(tid, spec) for spec in problem.nodes[problem.owner[tid]].owned[tid]], dtype=np.int64)

    for tid, (first, last) in problem.decided_live():
        if not _materialised(problem, tid, first):
            continue
        r = rep[problem.owner[tid]]
        b = owned(tid)
        spans[r].append((b, first + 1, last + 2))
        if cpu and last == n:
            reserved_of[r] = reserved_of.get(r, 0) + b
    for tid, op, share in problem.host_reads:  # a host-kept argument (or a slice) copied in for one op
        spans[rep[problem.owner[tid]]].append(((owned(tid) * share).astype(np.int64), op + 1, op + 2))
    combined_at = _combined_point(problem)
    for node in problem.nodes:
        if not node.size:
            continue
        per = [_reduction_buffers(problem, node, i, combined_at) for i in range(node.size)]
        for i, buffers in enumerate(per):
            for first, last, b in buffers:
                v = np.zeros(node.size, dtype=np.int64)
                v[i] = b
                spans[rep[node.index]].append((v, first, last + 1))
        if cpu:
            unfit = np.array([_unfit_buffers(problem, node, i) for i in range(node.size)], dtype=np.int64)
            if unfit.any():
                r = rep[node.index]
                reserved_of[r] = reserved_of.get(r, 0) + unfit
    delta = np.zeros(n + 3, dtype=np.int64)
    for e in problem.edges:
        at = _transient_point(problem, e)
        if _copied_only_if_resharded(problem, e):
            if not set(e.src_specs) & set(e.dst_specs):  # a copy only when resharded, and every pair reshards
                b = min(nbytes(e.tensor, spec) for spec in set(e.dst_specs))
                delta[at] += b
                delta[at + 1] -= b
            continue
        spans[rep[e.dst]].append((np.array([nbytes(e.tensor, spec) for spec in e.dst_specs], dtype=np.int64), at,
                                  at + 1))
    reserved = sum(int(np.min(v)) for v in reserved_of.values()) if cpu else 0
    return spans, delta, reserved


def _decision_table(items: list[tuple[np.ndarray, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(points, bytes): one decision's spans as the bytes each strategy keeps live from each of the
    points on (row per strategy; the last point's column is zero)."""
    points = np.unique(np.array([p for _, a, b in items for p in (a, b)]))
    where = {int(p): k for k, p in enumerate(points)}
    table = np.zeros((len(items[0][0]), len(points)), dtype=np.int64)
    for v, a, b in items:
        table[:, where[a]] += v
        table[:, where[b]] -= v
    return points, np.cumsum(table, axis=1)


def _memory_lower_bound(problem: Problem) -> np.ndarray:
    n = len(problem.graph.ops)
    spans, delta, reserved = _bound_parts(problem)
    delta = delta.copy()
    for items in spans.values():
        if len(items) == 1 or all(len(v) == 1 for v, _, _ in items):
            for v, a, b in items:
                m = int(v.min())
                delta[a] += m
                delta[b] -= m
            continue
        points, held = _decision_table(items)
        least = held.min(axis=0)  # the decision's least bytes from each point on
        steps = np.diff(least, prepend=0)
        np.add.at(delta, points, steps)
    profile = np.cumsum(delta)[: n + 2]
    return np.append(profile, reserved)


def over_budget_strategies(problem: Problem, budget: float) -> list[tuple[int, int]]:
    """(decision, strategy) pairs no plan under `budget` can take: with that strategy fixed, the
    memory lower bound already exceeds the budget somewhere. `memory_lower_bound` counts each
    decision's bytes at its least over its strategies, point by point; taking strategy i adds its
    excess over that least where it holds more, and the other decisions' terms stay lower bounds, so
    the bound plus that excess is a lower bound on the peak of every plan taking i. Sound (nothing
    that fits is excluded); `solve` fixes these to 0 before searching, so a budget near the bound
    leaves CP-SAT a far smaller search (GPT-39B single stage on 64 V100 16 GB: WORKSPACE.md)."""
    n = len(problem.graph.ops)
    found = problem._bounds.get("over_budget")
    if found is not None and found[0] == budget:
        return list(found[1])
    bound = memory_lower_bound(problem)[: n + 2]
    ext = np.append(bound, 0)  # a point after the last, so each span's end indexes it
    spans, _, _ = _bound_parts(problem)
    out = []
    for r, items in spans.items():
        if len(items[0][0]) < 2:
            continue
        points, held = _decision_table(items)
        excess = held - held.min(axis=0)
        top = np.maximum.reduceat(ext, points)[:-1]  # the bound's highest point in each span
        over = ((top + excess[:, :-1]) > budget).any(axis=1)
        out += [(r, int(i)) for i in np.flatnonzero(over)]
    problem._bounds["over_budget"] = (budget, tuple(out))
    return out
