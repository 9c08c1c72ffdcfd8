"""The intra-op ILP, solved with OR-tools CP-SAT.

Variables: one boolean per (node, strategy), exactly one true per node. Objective: each node's own
cost (compute + its collectives) plus the resharding cost of every edge. Resharding is costed per
part (`strategies.edge_parts`: each mesh axis, and each group of axes gathered together), so an
edge needs O(strategies x parts) auxiliary booleans instead of the O(strategies^2) of a pairwise
table; the sum over parts is the same number the pairwise table would hold (`strategies.edge_time`).
The memory budget is enforced lazily: solve, measure the plan's liveness peak, add a constraint at
each violated program point, solve again.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from ortools.sat.python import cp_model

from planner.errors import InfeasiblePlanError
from planner.ilp.objective import overlap_order, step_time
from planner.ilp.problem import Problem
from planner.ilp.strategies import edge_parts, edge_time, part_key, part_time, shard_bytes

log = logging.getLogger("planner")

_NS = 1e11  # objective unit: 10 picoseconds
_MEM_UNIT = 1024  # memory constraint unit: KiB


@dataclasses.dataclass(frozen=True, slots=True)
class Solution:
    """One strategy index per node, with how it was found.

    Attributes:
      choice: strategy index per node.
      objective_s: predicted communication + compute seconds under the ILP's model.
      status: "optimal", "feasible" (time limit hit; best plan found so far) or "heuristic" (the
        solver found nothing in time; the greedy plan).
      solve_time_s: wall time spent in the solver, all rounds together.
      peak_memory_bytes: per-device liveness peak of the plan.
      rounds: solver rounds (memory constraints are added lazily).
    """

    choice: tuple[int, ...]
    objective_s: float
    status: str
    solve_time_s: float
    peak_memory_bytes: int
    rounds: int


def memory_profile(problem: Problem, choice: Sequence[int]) -> np.ndarray:
    """Per-device bytes live at each program point under `choice`.

    Point k+1 is "while op k runs": its operands and results are live, and each operand is also
    counted in the layout the op reads it in (a resharded copy is a real transient buffer; when no
    resharding happens this double-counts one op's operands, a deliberate safety margin).
    """
    n = len(problem.graph.ops)
    delta = np.zeros(n + 3, dtype=np.int64)
    mesh = problem.cost.mesh
    for tid, (first, last) in enumerate(problem.live):
        if tid not in problem.owner:
            continue
        b = shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
        delta[first + 1] += b
        delta[last + 2] -= b
    profile = np.cumsum(delta)[: n + 2]
    for e in problem.edges:
        if e.op < 0 and e.src_specs[choice[e.src]] == e.dst_specs[choice[e.dst]]:
            continue  # a pinned output already in its layout: no copy
        b = shard_bytes(problem.graph.tensors[e.tensor], e.dst_specs[choice[e.dst]], mesh)
        profile[_transient_point(problem, e)] += b
    return profile


def _transient_point(problem: Problem, e) -> int:
    """Where an edge's operand copy is counted: at its consumer, except in the combinable tail of
    the program (the optimizer update), where XLA's combiners gather every resharded operand into
    one buffer that lives until the end; those all count at the last point."""
    if e.op < 0 or e.op in problem.combinable:  # op -1: a pinned output resharded at the end
        return len(problem.graph.ops) + 1
    return e.op + 1


def plan_cost(problem: Problem, choice: Sequence[int]) -> float:
    """The ILP objective of `choice`, recomputed directly (seconds): `objective.step_time`, the
    number the plan's prediction reports."""
    return step_time(problem, choice).total_s


class _Model:
    """CP-SAT model of one problem; memory constraints can be added between solves.

    Nodes that `Problem.rep` maps to one representative share its variables, and edges that become
    identical under that map are modelled once with their cost multiplied.
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.m = cp_model.CpModel()
        self.x: list[list] = []
        for node in problem.nodes:
            r = problem.rep[node.index]
            if r != node.index:
                self.x.append(self.x[r])
            elif node.size == 1:
                self.x.append([1])
            else:
                vs = [self.m.NewBoolVar(f"n{node.index}_{i}") for i in range(node.size)]
                self.m.AddExactlyOne(vs)
                self.x.append(vs)
        self.terms: list = []
        self.constant = 0
        own: dict[int, list[float]] = defaultdict(lambda: [0.0])
        for node in problem.nodes:
            acc = own.setdefault(problem.rep[node.index], [0.0] * node.size)
            for i, c in enumerate(node.costs):
                acc[i] += c
        for r, costs in own.items():
            for i, c in enumerate(costs):
                self._add_cost(self.x[r][i], c)
        merged: dict[tuple, int] = defaultdict(int)
        for e in problem.edges:
            t = problem.graph.tensors[e.tensor]
            merged[(problem.rep[e.src], problem.rep[e.dst], t, e.src_specs, e.dst_specs)] += 1
        for (src, dst, t, src_specs, dst_specs), mult in merged.items():
            self._edge(src, dst, t, src_specs, dst_specs, mult)
        self._combined_latency()
        self._overlap()
        for tin, tout in problem.ties:
            self._tie(tin, tout)
        self.objective = sum(self.terms) + self.constant

    def _combined_latency(self) -> None:
        """One latency per (kind, axes) group of combined collectives that any chosen strategy
        joins (`objective.step_time`): a boolean per group, implied by each strategy in it."""
        members: dict[tuple, list] = defaultdict(list)
        for node in self.problem.nodes:
            for i, groups in enumerate(node.combined):
                for g in groups:
                    members[g].append(self.x[node.index][i])
        for (kind, axes), xs in sorted(members.items()):
            ticks = int(round(self.problem.cost.collective_latency(kind, axes) * _NS))
            if ticks == 0:
                continue
            if any(isinstance(v, int) for v in xs):  # a node with one strategy always pays it
                self.constant += ticks
                continue
            g = self.m.NewBoolVar(f"combined_{kind}_{axes}")
            for v in {v.Index(): v for v in xs}.values():
                self.m.AddImplication(v, g)
            self.terms.append(ticks * g)

    def _overlap(self) -> None:
        """Replaces the combinable collectives' time by its exposed part (`objective.hidden_time`):
        the backlog of a first-in-first-out communication stream (Lindley's recursion), B_k >= a_k
        and B_k >= a_k + B_prev - (compute since the previous issue), exposed E >= B_last - (compute
        after the last issue), E >= 0; the objective takes E instead of the async times."""
        p = self.problem
        if not p.overlap or not any(t > 0 for n in p.nodes for t in n.async_s):
            return

        def expr(node, values):
            return sum(int(round(v * _NS)) * x for v, x in zip(values, self.x[node.index]) if round(v * _NS))

        order = overlap_order(p)
        bound = int(sum(max(n.costs) for n in order) * _NS) + 1
        backlog = None
        compute_since = 0
        for node in order:
            compute_since = compute_since + expr(node, [c - m for c, m in zip(node.costs, node.comm_s)])
            if not any(t > 0 for t in node.async_s):
                continue
            a = expr(node, node.async_s)
            b = self.m.NewIntVar(0, bound, "")
            self.m.Add(b >= a)
            if backlog is not None:
                self.m.Add(b >= a + backlog - compute_since)
            self.terms.append(-a)
            backlog, compute_since = b, 0
        exposed = self.m.NewIntVar(0, bound, "exposed_async")
        self.m.Add(exposed >= backlog - compute_since)
        self.terms.append(exposed)

    def _add_cost(self, var, seconds: float) -> None:
        self._add_ticks((var,), int(round(seconds * _NS)))

    def _add_ticks(self, variables, ticks: int) -> None:
        """Adds `ticks` objective units for each of `variables` (booleans, or constants 0/1)."""
        if ticks == 0:
            return
        for v in variables:
            if isinstance(v, int):
                self.constant += ticks * v
            else:
                self.terms.append(ticks * v)

    def _group(self, node: int, specs: Sequence) -> dict:
        out: dict = defaultdict(list)
        for i, s in enumerate(specs):
            out[s].append(self.x[node][i])
        return out

    def _edge(self, src: int, dst: int, t, src_specs, dst_specs, mult: int) -> None:
        """Resharding cost of one edge, per part, with a marginal (tight) linearisation.

        For a part (a mesh axis `a`, or a group of axes), booleans e[s, q] say "the producer picked
        spec s and the consumer's spec has key q" (the dim it puts `a` on; whether the group's axes
        all leave); their row sums equal the producer's spec indicators and their column sums the
        consumer's, which keeps the LP relaxation tight (Alpa's pairwise edge variables, factored
        per part).
        """
        cost = self.problem.cost
        if src == dst:
            for i, (s, r) in enumerate(zip(src_specs, dst_specs)):
                total = edge_time(t, s, r, cost)
                self._add_cost(self.x[src][i], total * mult)
            return
        by_src = self._group(src, src_specs)
        for part in edge_parts(cost.mesh):
            by_key: dict = defaultdict(list)
            for j, r in enumerate(dst_specs):
                by_key[part_key(part, r)].append(self.x[dst][j])
            keys = list(by_key)
            ticks = {s: tuple(int(round(part_time(t, s, part, q, cost) * mult * _NS)) for q in keys) for s in by_src}
            if not any(any(row) for row in ticks.values()):
                continue
            # Specs with equal cost rows (keys with equal cost columns) share one row (column): the
            # aggregated transportation polytope has the same LP bound with fewer booleans.
            rows: dict = defaultdict(list)
            for s, xs in by_src.items():
                rows[ticks[s]].extend(xs)
            col_of = [tuple(row[k] for row in rows) for k in range(len(keys))]
            cols: dict = defaultdict(list)
            for k, q in enumerate(keys):
                cols[col_of[k]].extend(by_key[q])
            if len(rows) == 1:  # the cost depends on the consumer's choice alone
                for col, xs in cols.items():
                    self._add_ticks(xs, col[0])
                continue
            if len(cols) == 1:  # on the producer's alone
                (col,) = cols
                for r, ys in enumerate(rows.values()):
                    self._add_ticks(ys, col[r])
                continue
            e = {(r, c): self.m.NewBoolVar("") for r in range(len(rows)) for c in range(len(cols))}
            for r, ys in enumerate(rows.values()):
                self.m.Add(sum(e[(r, c)] for c in range(len(cols))) == sum(ys))
            for c, xs in enumerate(cols.values()):
                self.m.Add(sum(e[(r, c)] for r in range(len(rows))) == sum(xs))
            for c, col in enumerate(cols):
                for r in range(len(rows)):
                    self._add_ticks([e[(r, c)]], col[r])

    def _tie(self, tin: int, tout: int) -> None:
        p = self.problem
        a, b = p.owner[tin], p.owner[tout]
        ga = self._group(a, p.nodes[a].owned[tin])
        gb = self._group(b, p.nodes[b].owned[tout])
        if a == b:
            for i, (si, so) in enumerate(zip(p.nodes[a].owned[tin], p.nodes[a].owned[tout])):
                if si != so:
                    self.m.Add(self.x[a][i] == 0) if not isinstance(self.x[a][i], int) else self.m.Add(0 == 1)
            return
        for s in set(ga) | set(gb):
            lhs, rhs = sum(ga.get(s, [])), sum(gb.get(s, []))
            if isinstance(lhs, int) and isinstance(rhs, int):  # both sides pinned (`planner.pins`)
                if lhs != rhs:
                    self.m.AddBoolOr([])  # contradictory pins: infeasible
                continue
            self.m.Add(lhs == rhs)

    def memory_expr(self, point: int):
        """Per-device KiB live at op index `point`, as a linear expression of the choice."""
        p = self.problem
        coef: dict[tuple[int, int], int] = defaultdict(int)
        for tid, (first, last) in enumerate(p.live):
            if tid not in p.owner or not (first < point <= last + 1):
                continue
            node = p.nodes[p.owner[tid]]
            t = p.graph.tensors[tid]
            for i, spec in enumerate(node.owned[tid]):
                coef[(p.rep[node.index], i)] += shard_bytes(t, spec, p.cost.mesh)
        for e in p.edges:  # operands as the op reads them (a resharded copy is a transient buffer)
            if _transient_point(p, e) == point:
                t = p.graph.tensors[e.tensor]
                for j, spec in enumerate(e.dst_specs):
                    coef[(p.rep[e.dst], j)] += shard_bytes(t, spec, p.cost.mesh)
        return sum(-(-c // _MEM_UNIT) * self.x[n][i] for (n, i), c in coef.items())

    def solve(self, time_limit: float, workers: int, hint: Sequence[int] | None):
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.1, time_limit)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = 0
        # Presolve costs more than it saves on these models (measured: 11.8 s -> 5.5 s for gpt-tiny
        # on 2x4, 14.6 s -> 9.0 s for gpt2-small, same optimum): the model is already compact.
        solver.parameters.cp_model_presolve = False
        if hint is not None:
            self.m.ClearHints()
            for node, i in enumerate(hint):
                if self.problem.rep[node] != node:
                    continue
                for j, v in enumerate(self.x[node]):
                    if not isinstance(v, int):
                        self.m.AddHint(v, int(i == j))
        status = solver.Solve(self.m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, status
        choice = []
        for vs in self.x:
            choice.append(next(i for i, v in enumerate(vs) if isinstance(v, int) and v == 1 or
                               not isinstance(v, int) and solver.BooleanValue(v)))
        return tuple(choice), status


def greedy(problem: Problem) -> tuple[int, ...]:
    """A quick feasible plan: nodes in program order, each taking the strategy that is cheapest
    given the choices already made upstream (own cost + resharding of its operands), restricted to
    keep tied outputs equal to their inputs. Used as the solver's starting hint and as the answer
    of last resort when the solver finds nothing in its time limit."""
    choice = [0] * len(problem.nodes)
    incoming: dict[int, list] = defaultdict(list)
    for e in problem.edges:
        incoming[e.dst].append(e)
    tied_out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for tin, tout in problem.ties:
        tied_out[problem.owner[tout]].append((tin, tout))
    done: set[int] = set()
    for node in problem.nodes:
        r = problem.rep[node.index]
        if r in done:
            choice[node.index] = choice[r]
            continue
        best, best_cost = 0, None
        for i in range(node.size):
            if any(problem.owner[tin] in done and node.owned[tout][i] != problem.spec(tin, choice)
                   for tin, tout in tied_out[node.index]):
                continue
            c = node.costs[i]
            for e in incoming[node.index]:
                if e.src in done:
                    t = problem.graph.tensors[e.tensor]
                    src, dst = e.src_specs[choice[e.src]], e.dst_specs[i]
                    c += edge_time(t, src, dst, problem.cost)
            if best_cost is None or c < best_cost:
                best, best_cost = i, c
        choice[node.index] = best
        done.add(node.index)
    return tuple(choice)


def _ties_hold(problem: Problem, choice: Sequence[int]) -> bool:
    return all(problem.spec(a, choice) == problem.spec(b, choice) for a, b in problem.ties)


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


def solve(problem: Problem, memory_budget: float | None = None, time_limit: float = 30.0,
          workers: int = 1, max_rounds: int = 30) -> Solution:
    """Solves the ILP; with a budget, adds memory constraints until the plan's peak fits.

    Raises:
      InfeasiblePlanError: when no plan fits `memory_budget`; the message and `min_memory_bytes`
        give the smallest per-device peak the planner could reach.
    """
    start = time.perf_counter()
    model = _Model(problem)
    model.m.Minimize(model.objective)
    points: set[int] = set()
    fallback = greedy(problem)
    hint = fallback if _ties_hold(problem, fallback) else None
    status_name = "optimal"
    for rounds in range(1, max_rounds + 1):
        left = time_limit - (time.perf_counter() - start)
        choice, status = model.solve(left, workers, hint)
        if choice is None:
            if status == cp_model.INFEASIBLE and memory_budget is not None:
                raise _infeasible(problem, memory_budget, time_limit, workers)
            fits = memory_budget is None or memory_profile(problem, fallback).max() <= memory_budget
            if status == cp_model.UNKNOWN and _ties_hold(problem, fallback) and fits:
                log.warning("solver found no plan within %.0fs: using the greedy plan (raise solver_time_limit "
                            "for a better one)", time_limit)
                choice, status_name = fallback, "heuristic"
                profile = memory_profile(problem, choice)
                break
            raise InfeasiblePlanError(
                f"the solver found no plan within {time_limit:.0f}s (status {cp_model.CpSolver().StatusName(status)}); "
                "raise solver_time_limit"
            )
        if status != cp_model.OPTIMAL:
            status_name = "feasible"
        profile = memory_profile(problem, choice)
        if memory_budget is None:
            break
        new = _violations(profile, memory_budget, points)
        if not new:
            if profile.max() > memory_budget:
                raise _infeasible(problem, memory_budget, time_limit, workers)
            break
        for p in new:
            model.m.Add(model.memory_expr(p) <= int(memory_budget // _MEM_UNIT))
            points.add(p)
        hint = choice
        log.info("memory round %d: peak %.3g B over budget %.3g B, %d constraints", rounds, profile.max(),
                 memory_budget, len(points))
        if time.perf_counter() - start > time_limit:
            status_name = "feasible"
            raise InfeasiblePlanError(
                f"no plan fitting {memory_budget:.4g} bytes per device was found within the solver time limit "
                f"({time_limit:.0f}s); the best plan so far needs {profile.max():.4g} bytes; raise solver_time_limit",
                int(profile.max()),
            )
    elapsed = time.perf_counter() - start
    if status_name == "feasible":
        log.warning("solver time limit (%.0fs) reached: returning the best plan found, not proven optimal", time_limit)
    return Solution(tuple(choice), plan_cost(problem, choice), status_name, elapsed, int(profile.max()), rounds)


def _infeasible(problem: Problem, budget: float, time_limit: float, workers: int) -> InfeasiblePlanError:
    """Finds the smallest liveness peak reachable (minimising peak memory) for the error message."""
    model = _Model(problem)
    total = sum(t.nbytes for t in problem.graph.tensors) // _MEM_UNIT + 1
    peak = model.m.NewIntVar(0, total, "peak")
    model.m.Minimize(peak)
    points: set[int] = set()
    best = None
    choice = None
    for _ in range(20):
        choice, status = model.solve(time_limit, workers, choice)
        if choice is None:
            log.warning("minimum-memory search stopped: solver status %s", cp_model.CpSolver().StatusName(status))
            break
        profile = memory_profile(problem, choice)
        best = int(profile.max()) if best is None else min(best, int(profile.max()))
        new = [int(np.argmax(profile))]
        if new[0] in points:
            break
        for p in new:
            model.m.Add(model.memory_expr(p) <= peak)
            points.add(p)
    reach = f"{best:.4g}" if best is not None else "unknown"
    return InfeasiblePlanError(
        f"no plan fits the memory budget of {budget:.4g} bytes per device; the smallest per-device peak the "
        f"planner could reach is {reach} bytes; raise memory_budget or use more devices",
        best,
    )
