"""Local moves from a plan, one decision (and the decisions tied to it) at a time: coordinate
descent on the step time (`improve`) and a repair that takes a plan under a memory budget (`repair`)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from planner.ilp.cpsat import plan_cost
from planner.ilp.liveness import _materialised, memory_profile
from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes


class _Local:
    """Per distinct decision of `problem`: its nodes, the edges touching them and the ties it takes
    part in, for the local cost of changing it alone (`improve`, `repair`)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.members: dict[int, list[int]] = defaultdict(list)
        for node in problem.nodes:
            self.members[problem.rep[node.index]].append(node.index)
        self.touching: dict[int, list] = defaultdict(list)
        for e in problem.edges:
            self.touching[problem.rep[e.src]].append(e)
            if problem.rep[e.dst] != problem.rep[e.src]:
                self.touching[problem.rep[e.dst]].append(e)
        self.tied: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for a, b in problem.ties:
            self.tied[problem.rep[problem.owner[a]]].append((a, b))
            if problem.rep[problem.owner[b]] != problem.rep[problem.owner[a]]:
                self.tied[problem.rep[problem.owner[b]]].append((a, b))

    def cost(self, current: list[int], r: int, i: int) -> float | None:
        """The local cost of decision `r` taking strategy `i` in `current` (its nodes' own costs plus
        the resharding of every edge touching them, the others fixed); None: it breaks a tie."""
        problem = self.problem
        old = current[r]
        self.take(current, r, i)
        ok = all(problem.spec(a, current) == problem.spec(b, current) for a, b in self.tied[r])
        cost = self._local_sum(current, (r,), self.touching[r]) if ok else None
        self.take(current, r, old)
        return cost

    def _local_sum(self, current: list[int], decisions, edges) -> float:
        """The own costs of `decisions`' nodes plus the resharding of `edges`, as `current` lays them out."""
        problem = self.problem
        return sum(problem.nodes[m].costs[current[m]] for r in decisions for m in self.members[r]) + sum(
            problem.edge_time(e.tensor, e.src_specs[current[e.src]], e.dst_specs[current[e.dst]], e.op) for e in edges)

    def take(self, current: list[int], r: int, i: int) -> None:
        for m in self.members[r]:
            current[m] = i

    def together(self, current: list[int], r: int, i: int) -> dict[int, int] | None:
        """Decision `r` taking strategy `i` with the decisions tied to it following so that every tie
        holds (each tied decision its cheapest strategy matching `r`'s layout, by `cost` with `r`
        changed): {decision: strategy}, or None when a tie cannot hold. One level: a follower's
        other ties must already hold."""
        problem = self.problem
        moves = {r: i}
        old = current[r]
        self.take(current, r, i)
        try:
            for a, b in self.tied[r]:
                if problem.spec(a, current) == problem.spec(b, current):
                    continue
                other = problem.rep[problem.owner[b] if problem.rep[problem.owner[a]] == r else problem.owner[a]]
                if other in moves:
                    return None
                best = None
                for j in range(problem.nodes[other].size):
                    c = self.cost(current, other, j)
                    if c is not None and (best is None or c < best[0]):
                        best = (c, j)
                if best is None:
                    return None
                moves[other] = best[1]
            return moves
        finally:
            self.take(current, r, old)

    def joint_cost(self, current: list[int], moves: dict[int, int]) -> float:
        """The local cost of the decisions in `moves` taking their strategies together: their nodes'
        own costs and every edge touching any of them, once."""
        old = {r: current[r] for r in moves}
        for r, i in moves.items():
            self.take(current, r, i)
        edges = {id(e): e for r in moves for e in self.touching[r]}
        cost = self._local_sum(current, moves, edges.values())
        for r, i in old.items():
            self.take(current, r, i)
        return cost


def improve(problem: Problem, choice: Sequence[int], sweeps: int = 3) -> tuple[int, ...]:
    """Coordinate descent from `choice`: per distinct decision in turn, the strategy with the lowest
    local cost (`_Local.cost`: its nodes' own costs plus the resharding of every edge touching them,
    the others fixed) that keeps its ties, for up to `sweeps` passes; returned only if the whole
    objective (`plan_cost`, with the latency groups and the overlap the local cost leaves out) does
    not get worse. Makes the solver's hint and its answer of last resort better (on small
    remat-wrapped attention blocks it reaches the optimum from a greedy plan far above it)."""
    current = list(choice)
    local = _Local(problem)
    for _ in range(sweeps):
        moved = False
        for r in local.members:
            if problem.nodes[r].size <= 1:
                continue
            best_i, best = current[r], local.cost(current, r, current[r])
            if best is None:
                continue
            for i in range(problem.nodes[r].size):
                c = local.cost(current, r, i) if i != best_i else None
                if c is not None and c < best * (1 - 1e-12) - 1e-18:
                    best_i, best = i, c
            if best_i != current[r]:
                local.take(current, r, best_i)
                moved = True
        if not moved:
            break
    better = tuple(current)
    return better if plan_cost(problem, better) <= plan_cost(problem, choice) else tuple(choice)


REPAIR_ROUNDS = 8  # most passes of `repair` (each re-profiles the plan) before giving up


def repair(problem: Problem, choice: Sequence[int], budget: float,
           excluded: Sequence[tuple[int, int]] = ()) -> tuple[int, ...] | None:
    """A plan under `budget` near `choice`, which is over it; None when none is found within
    `REPAIR_ROUNDS` passes. Each pass works on the highest point of the memory profile: per decision
    holding tensors live there, its strategy (not in `excluded`, keeping its ties) adding the least
    local cost (`_Local.cost`) per byte it takes off that point; those changes, cheapest per byte
    first, until they take off the excess (greedy knapsack cover; decisions are changed alone, so
    the next pass re-profiles the plan).

    `solve` starts each memory round after the first from it: the previous round's plan is over the
    budget by a few percent, and CP-SAT spends most of the round finding any plan under the new
    constraint from it; from a plan under the budget next to it, CP-SAT reaches the same optimum
    far sooner."""
    local = _Local(problem)
    banned = set(excluded)
    mesh = problem.cost.mesh
    decided: dict[int, list[int]] = defaultdict(list)  # decision -> the tensors it lays out that take memory
    for tid, node in problem.owner.items():
        if _materialised(problem, tid, problem.live[tid][0]):
            decided[problem.rep[node]].append(tid)
    current = list(choice)

    def held(tids: list[int], i: int) -> int:
        return sum(shard_bytes(problem.graph.tensors[t], problem.nodes[problem.owner[t]].owned[t][i], mesh)
                   for t in tids)

    for _ in range(REPAIR_ROUNDS):
        profile = memory_profile(problem, current)
        point = int(np.argmax(profile))
        excess = int(profile[point]) - budget
        if excess <= 0:
            return tuple(current)
        here = {r: [t for t in tids if problem.live[t][0] + 1 <= point <= problem.live[t][1] + 1]
                for r, tids in decided.items()}
        moves, seen = [], set()
        for r, tids in here.items():
            if not tids or problem.nodes[r].size <= 1 or r in seen:
                continue
            best = None
            for i in range(problem.nodes[r].size):
                if i == current[r]:
                    continue
                group = local.together(current, r, i)
                if group is None or any((d, j) in banned for d, j in group.items()):
                    continue
                saved = sum(held(here.get(d, []), current[d]) - held(here.get(d, []), j) for d, j in group.items())
                if saved <= 0:
                    continue
                extra = local.joint_cost(current, group) - local.joint_cost(current, {d: current[d] for d in group})
                if best is None or extra / saved < best[0]:
                    best = (extra / saved, saved, tuple(sorted(group.items())))
            if best is not None:
                moves.append(best)
                seen.update(d for d, _ in best[2])
        if not moves:
            return None
        taken: set[int] = set()
        for _, saved, group in sorted(moves):
            if any(d in taken for d, _ in group):
                continue
            for d, j in group:
                local.take(current, d, j)
                taken.add(d)
            excess -= saved
            if excess <= 0:
                break
    return None
