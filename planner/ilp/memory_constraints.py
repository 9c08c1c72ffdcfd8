"""The CP-SAT model's memory constraints, added lazily: the bytes live at a program point as a
linear expression of the choice (`memory_expr`), and which points a plan over the budget needs
constrained (`_violations`, `_cut_key`)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from planner.ilp.liveness import (
    _borrowed,
    _combined_point,
    _copied_only_if_resharded,
    _materialised,
    _reduction_buffers,
    _reserved_point,
    _transient_point,
    _unfit_buffers,
    _xla_cpu,
)
from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes
from planner.ilp.ticks import _MEM_UNIT


def memory_expr(model, point: int, choice: Sequence[int] | None = None):
    """Per-device bytes live at program point `point`, as a linear expression of the choice:
    `memory_profile`'s count term by term (tests/test_memory.py compares them).

    `memory_profile`'s XLA:CPU output buffers (`_borrowed`) depend on which temporaries fit
    which unwritten output, which no linear expression says; with `choice` (the plan whose peak
    broke the budget there) the expression counts every output not yet written at `point` and
    leaves out the temporaries that plan's unwritten outputs hold, so it equals the profile at
    `choice` and holds those temporaries in those buffers for every other plan. Without it, the
    liveness count alone (every unwritten output's bytes free for any temporary: a lower bound
    of the profile, which `memory_lower_bound` also follows)."""
    p = model.problem
    coef: dict[tuple[int, int], int] = defaultdict(int)
    copies: dict = defaultdict(int)
    if choice is not None and point < _reserved_point(p) and _xla_cpu(p):
        _borrowed_terms(model, point, choice, coef, copies)
    if point == _reserved_point(p):
        return _reserved_expr(model) if _xla_cpu(p) else 0
    for tid, (first, last) in p.decided_live():
        if not (first < point <= last + 1) or not _materialised(p, tid, first):
            continue
        node = p.nodes[p.owner[tid]]
        for i, b in enumerate(_sizes(model, tid, tid, node.owned[tid])):
            coef[(p.rep[node.index], i)] += b
    for tid, op, share in p.host_reads:  # a host-kept argument (or its share: one slice) copied in for one op
        if op + 1 == point:
            node = p.nodes[p.owner[tid]]
            for i, b in enumerate(_sizes(model, tid, tid, node.owned[tid])):
                coef[(p.rep[node.index], i)] += int(b * share)
    for k, e in enumerate(p.edges):  # operands as the op reads them (a resharded copy is a transient buffer)
        if _transient_point(p, e) == point:
            for j, b in enumerate(_sizes(model, -1 - k, e.tensor, e.dst_specs)):
                if _copied_only_if_resharded(p, e):  # only when resharded (`memory_profile`)
                    copies[_copy_var(model, e, j)] += b
                else:
                    coef[(p.rep[e.dst], j)] += b
    if model.reductions is None:
        combined_at = _combined_point(p)
        model.reductions = [(p.rep[node.index], i, first, last, b) for node in p.nodes for i in range(node.size)
                            for first, last, b in _reduction_buffers(p, node, i, combined_at)]
    for n, i, first, last, b in model.reductions:  # XLA:CPU's reduction buffers
        if first <= point <= last:
            coef[(n, i)] += b
    return (sum(-(-c // _MEM_UNIT) * model.x[n][i] for (n, i), c in coef.items() if c)
            + sum(-(-c // _MEM_UNIT) * z for z, c in copies.items() if c and (not isinstance(z, int) or z)))


def _reserved_expr(model):
    """`memory_expr` at `liveness._reserved_point`: XLA:CPU's accounting while the combined gradient
    reduction runs (every argument and output, and the reduction buffers no output can hold)."""
    p = model.problem
    coef: dict[tuple[int, int], int] = defaultdict(int)
    n = len(p.graph.ops)
    for tid, (first, last) in p.decided_live():
        if last == n and _materialised(p, tid, first):
            node = p.nodes[p.owner[tid]]
            for i, b in enumerate(_sizes(model, tid, tid, node.owned[tid])):
                coef[(p.rep[node.index], i)] += b
    for node in p.nodes:
        for i in range(node.size):
            coef[(p.rep[node.index], i)] += _unfit_buffers(p, node, i)
    return sum(-(-c // _MEM_UNIT) * model.x[n][i] for (n, i), c in coef.items() if c)


def _borrowed_terms(model, point: int, choice: Sequence[int], coef: dict, copies: dict) -> None:
    """Adds to `memory_expr`'s terms at `point` every output not yet written there and takes
    away the temporaries `choice`'s unwritten outputs hold (`_borrowed`)."""
    p = model.problem
    _, held, done = _borrowed(p, choice)
    if point not in done:
        return
    n = len(p.graph.ops)
    donated_outputs = {tout for _, tout in p.donated}
    for tid in {x for x in p.graph.outputs if isinstance(x, int)} - donated_outputs:
        first, last = p.live[tid]
        if last == n and first + 1 > point and _materialised(p, tid, first):
            node = p.nodes[p.owner[tid]]
            for i, b in enumerate(_sizes(model, tid, tid, node.owned[tid])):
                coef[(p.rep[node.index], i)] += b
    for key in held.get(point, ()):
        if key[0] == "t":
            node = p.nodes[p.owner[key[1]]]
            for i, b in enumerate(_sizes(model, key[1], key[1], node.owned[key[1]])):
                coef[(p.rep[node.index], i)] -= b
        elif key[0] == "e":
            e = p.edges[key[1]]
            for j, b in enumerate(_sizes(model, -1 - key[1], e.tensor, e.dst_specs)):
                if _copied_only_if_resharded(p, e):
                    copies[_copy_var(model, e, j)] -= b
                else:
                    coef[(p.rep[e.dst], j)] -= b
        else:  # a reduction buffer of node key[1] under its strategy key[2]
            coef[(p.rep[key[1]], key[2])] -= key[3]


def _sizes(model, key: int, tid: int, specs) -> list[int]:
    """Per-device bytes of tensor `tid` in each of `specs` (`key`: the tensor's id for the specs
    its owner gives it, -1 - k for edge k's consumer specs), computed once per model: each
    memory round and the minimum-peak search ask for the same tensors at several points."""
    found = model.sizes.get(key)
    if found is None:
        t = model.problem.graph.tensors[tid]
        found = model.sizes[key] = [shard_bytes(t, spec, model.problem.cost.mesh) for spec in specs]
    return found


def _copy_var(model, e, j: int):
    """A boolean that is 1 when the consumer of edge `e` reads it in its spec `j` and the
    producer's spec differs (z >= x_dst[j] - sum of the producer's indicators of that spec;
    minimised by the memory bound, so it is exactly the copy indicator where it matters)."""
    p = model.problem
    key = (p.rep[e.src], p.rep[e.dst], e.src_specs, e.dst_specs, j)
    if key not in model.copies:
        same = sum(model.x[e.src][i] for i, s in enumerate(e.src_specs) if s == e.dst_specs[j])
        need = model.x[e.dst][j] - same
        if isinstance(need, int):
            model.copies[key] = max(0, need)
        else:
            z = model.m.NewBoolVar("")
            model.m.Add(z >= need)
            model.copies[key] = z
    return model.copies[key]


def _cut_key(problem: Problem, choice: Sequence[int], point: int) -> tuple:
    """What a memory constraint added at `point` from `choice` (`memory_expr`) stands for:
    the point and, on XLA:CPU, the temporaries `choice`'s unwritten outputs hold there (`_borrowed`).
    A later plan over the budget at the same point with other temporaries held needs a new one."""
    return point, tuple(_borrowed(problem, choice)[1].get(point, ()))


def _settled(problem: Problem, choice: Sequence[int], added: set[tuple]) -> set[int]:
    """The points where a constraint already added covers `choice` (the same `_cut_key`)."""
    return {p for p, held in added if _cut_key(problem, choice, p)[1] == held}


def _violations(profile: np.ndarray, limit: float, have: set[int], k: int = 4) -> list[int]:
    """Up to `k` distinct program points over `limit`, highest first, spread apart."""
    order = np.argsort(-profile, kind="stable")
    picked: list[int] = []
    gap = max(1, len(profile) // 50)
    for p in order:
        if profile[p] <= limit or len(picked) >= k:
            break
        if int(p) in have or any(abs(int(p) - q) < gap for q in picked):
            continue
        picked.append(int(p))
    return picked
