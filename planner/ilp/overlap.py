"""The CP-SAT terms of time that runs beside compute: the combinable collectives' exposed part,
the arguments' prefetch and the host-offload copies, each the backlog of a first-in-first-out stream
in max-plus form. Each `add_*` adds its term to a `cpsat._Model` as it is built."""
from __future__ import annotations

from collections import defaultdict

from planner.ilp.layer_sharing import tandem_runs
from planner.ilp.objective import offload_start, overlap_order
from planner.ilp.strategies import shard_bytes
from planner.ilp.ticks import _NS


def _compute_ticks(node) -> tuple[int, ...]:
    """Per strategy, the node's compute (its cost less its own collectives) in objective units."""
    return tuple(int(round((c - m) * _NS)) for c, m in zip(node.costs, node.comm_s))


def _lin(x, ticks):
    return sum(t * v for t, v in zip(ticks, x) if t)


def add_overlap(model) -> None:
    """Adds the combinable collectives' exposed part (`objective.hidden_time`; their async time
    itself is taken out of the node costs, `cpsat._Model._own_costs`).

    The exposed part is the backlog of a first-in-first-out communication stream. Walking the
    nodes in program order with R the backlog left at the current point (R = -inf before the
    first async issue), a node computing c and issuing a maps R -> max(a, a + R - c) (Lindley's
    recursion), one without async time R -> R - c; at the end E = max(0, R). Every such map has
    the form R -> max(alpha, R + beta), and so has any composition of them (max-plus algebra:
    g(f(R)) = max(alpha_g, alpha_f + beta_g, R + beta_f + beta_g)). A segment of nodes is modelled
    once: beta is its sum of (a - c), alpha the backlog it leaves from R = -inf (a chain of
    integer variables, one per issuing node). A run of L identical segments (repeated layers:
    the same shared decisions with the same costs, in the same order) is
        R -> max(alpha, alpha + (L - 1) beta, R + L beta)
    (the maximum over i of alpha + i beta sits at an end), one variable and three constraints
    whatever L is; runs are found by `layer_sharing.tandem_runs` on the nodes' (shared decision,
    compute, async) sequence, and any cut of the sequence gives the same value. Every
    constraint bounds a variable from below by an expression increasing in the variables
    before it, so the minimum holds E at the exact value for the chosen strategies.
    """
    p = model.problem
    if not model.overlap_on:
        return
    ids: dict[tuple, int] = {}
    seq: list[int] = []
    info: list[tuple] = []  # per key id: (compute expression, issued expression or None)
    bound = 1
    for node in overlap_order(p):
        compute = _compute_ticks(node)
        issued = tuple(int(round(a * _NS)) for a in node.async_s)
        bound += int(max(node.costs) * _NS) + 1
        if not any(compute) and not any(issued):
            continue
        key = (p.rep[node.index], compute, issued)
        if key not in ids:
            ids[key] = len(info)
            x = model.x[node.index]
            info.append((_lin(x, compute), _lin(x, issued) if any(issued) else None))
        seq.append(ids[key])
    model.terms.append(_backlog(model, seq, info, bound))


def add_prefetch(model) -> None:
    """Adds the exposed part of the arguments' resharding (`objective.prefetch_hidden`): issued
    in order of their consumers from the start of the step on one link, each needed before its
    consumer computes. The stall max over k of (prefetch up to k - compute before k) is the
    backlog of the same first-in-first-out recursion as `add_overlap` run over the nodes in
    reverse program order, each node issuing its consumers' prefetch after its compute."""
    p = model.problem
    if not model.prefetch_expr:
        return
    ids: dict[tuple, int] = {}
    seq: list[int] = []
    info: list[tuple] = []
    bound = 1 + model.sink_ticks * max(1, len(model.prefetch_of))
    for node in reversed(overlap_order(p)):
        compute = _compute_ticks(node)
        bound += int(max(node.costs) * _NS) + 1
        keys = tuple(sorted(model.prefetch_of.get(node.index, ()), key=repr))
        if not any(compute) and not keys:
            continue
        key = (p.rep[node.index], compute, keys)
        if key not in ids:
            ids[key] = len(info)
            issued = sum(sum(model.prefetch_expr[k]) for k in keys) if keys else None
            info.append((_lin(model.x[node.index], compute), issued))
        seq.append(ids[key])
    model.terms.append(_backlog(model, seq, info, bound))


def add_offload(model) -> None:
    """Adds the host-offload copies (`objective.offload_transfer`, `offload_hidden`): the copies
    back in full; the copies in in full without overlap, else max(0, copies in - compute before
    `objective.offload_start`) in one integer variable (minimised, so exact)."""
    p = model.problem
    if not p.offloaded:
        return
    bandwidth = p.cost.hardware.host_bandwidth
    copy_in: dict[tuple[int, int], int] = defaultdict(int)
    reads: dict[int, float] = defaultdict(float)  # copies in before the update (`Problem.host_reads`)
    for t, _, share in p.host_reads:
        reads[t] += share
    for tin, tout in p.offloaded:
        node = p.nodes[p.owner[tin]]
        for i, spec in enumerate(node.owned[tin]):
            ticks = int(round(shard_bytes(p.graph.tensors[tin], spec, p.cost.mesh) / bandwidth * _NS))
            copy_in[(node.index, i)] += int(round(ticks * (1 + reads[tin])))
            if tout >= 0:
                model.add_ticks((model.x[node.index][i],), ticks)
    if not p.overlap or p.graph.update_groups or p.host_reads:  # exposed (`objective.offload_hidden`)
        for (n, i), ticks in copy_in.items():
            model.add_ticks((model.x[n][i],), ticks)
        return
    start = offload_start(p)
    before: dict[tuple[int, int], int] = defaultdict(int)
    for node in overlap_order(p):
        if node.ops[0] >= start:
            break
        for i, t in enumerate(_compute_ticks(node)):
            before[(node.index, i)] += t
    exposed = model.m.NewIntVar(0, sum(copy_in.values()) + 1, "exposed_offload")
    model.m.Add(exposed >= sum(t * model.x[n][i] for (n, i), t in copy_in.items())
                - sum(t * model.x[n][i] for (n, i), t in before.items() if t))
    model.terms.append(exposed)


def _backlog(model, seq: list[int], info: list[tuple], bound: int):
    """The exposed backlog (an integer variable, objective units) of a first-in-first-out stream
    over `seq` (ids into `info`: per item its compute expression and its issued expression, or
    None when it issues nothing), in max-plus form; see `add_overlap`."""

    def chain(state, items):
        """The backlog after `items` (key ids) from `state` (None: -inf), one variable per issue."""
        for k in items:
            compute, a = info[k]
            if a is None:
                state = None if state is None else state - compute
                continue
            b = model.m.NewIntVar(0, bound, "")
            model.m.Add(b >= a)
            if state is not None:
                model.m.Add(b >= a + state - compute)
            state = b
        return state

    segments: dict[tuple[int, ...], tuple] = {}

    def run(state, items, repeats):
        """The backlog after `repeats` copies of `items` from `state`, in closed form."""
        if items not in segments:
            beta = sum((info[k][1] if info[k][1] is not None else 0) - info[k][0] for k in items)
            segments[items] = (chain(None, items), beta)
        alpha, beta = segments[items]
        if alpha is None:  # no issue in the segment: a shift
            return None if state is None else state + repeats * beta
        r = model.m.NewIntVar(-bound, bound, "")
        model.m.Add(r >= alpha)
        model.m.Add(r >= alpha + (repeats - 1) * beta)
        if state is not None:
            model.m.Add(r >= state + repeats * beta)
        return r

    state = None
    covered = 0
    for start, period, length in tandem_runs(seq) + [(len(seq), 1, 0)]:
        state = chain(state, seq[covered:start])  # items in no run
        repeats = length // period
        if repeats:
            state = run(state, tuple(seq[start:start + period]), repeats)
        state = chain(state, seq[start + repeats * period:start + length])  # a last copy in part
        covered = start + length
    exposed = model.m.NewIntVar(0, bound, "exposed_async")
    if state is not None:
        model.m.Add(exposed >= state)
    return exposed
