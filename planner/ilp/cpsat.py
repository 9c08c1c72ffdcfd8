"""The CP-SAT model of one problem (`_Model`) and one run of it (`_Model.solve`).

Variables: one boolean per (node, strategy), exactly one true per node. Objective: each node's own
cost (compute + its collectives) plus the resharding cost of every edge. Resharding is costed per
part (`strategies.edge_parts`: each mesh axis, and each group of axes gathered together), so an
edge needs O(strategies x parts) auxiliary booleans instead of the O(strategies^2) of a pairwise
table; the sum over parts is the same number the pairwise table would hold (`strategies.edge_time`).
The time run beside compute is added by `ilp.overlap`; memory constraints by
`ilp.memory_constraints`, between runs.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from planner.ilp.memory_constraints import memory_expr
from planner.ilp.objective import prefetched, step_time
from planner.ilp.overlap import add_offload, add_overlap, add_prefetch
from planner.ilp.problem import Problem
from planner.ilp.edge_forms import edge_form
from planner.ilp.strategies import edge_time
from planner.ilp.ticks import _NS

WALL_CAP_FACTOR = 4.0  # wall-clock safety cap: this multiple of the deterministic limit ...
WALL_CAP_FLOOR_S = 10.0  # ... plus this many seconds (short limits are not left to scheduling noise)


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
        self.x: list[list] = self._variables()
        self.terms: list = []  # objective expressions (`overlap`); single booleans' costs go to `_vars`/`_coeffs`
        self._vars: list = []
        self._coeffs: list[int] = []
        self.constant = 0
        self.sink: list | None = None  # while set, `add_ticks` collects terms there (`overlap.add_prefetch`)
        self.sink_ticks = 0  # the sum of every coefficient collected there (a bound on their value)
        # With overlap, the combinable collectives' async time leaves the node costs;
        # `overlap.add_overlap` adds back its exposed part.
        self.overlap_on = problem.overlap and any(t > 0 for n in problem.nodes for t in n.async_s)
        self._own_costs()
        # With overlap, resharding an argument for its consumer (`objective.prefetched`) leaves the
        # objective; `overlap.add_prefetch` adds back the part not hidden behind earlier compute.
        self.prefetch_expr: dict[tuple, list] = {}
        self.prefetch_of: dict[int, list[tuple]] = defaultdict(list)
        self._edges()
        self._combined_latency()
        add_overlap(self)
        add_prefetch(self)
        add_offload(self)
        self._ties()
        # one weighted sum for the booleans' costs: CP-SAT flattens the objective into one proto entry
        # per variable (merged, in index order) however it is written, and this way builds fastest
        self.objective = cp_model.LinearExpr.weighted_sum(self._vars, self._coeffs) + sum(self.terms) + self.constant
        self.copies: dict = {}  # (edge key, consumer spec) -> "operand copied" boolean (`memory_constraints`)
        self.sizes: dict = {}  # tensor id or -1 - edge index -> bytes per spec (`memory_constraints`)
        self.reductions: list | None = None  # (node, strategy, first, last point, bytes): `_reduction_buffers`

    @property
    def rounded_terms(self) -> int:
        """How many objective terms were rounded to whole ticks (each by at most half a tick)."""
        return len(self._coeffs) + len(self.terms)

    def _variables(self) -> list[list]:
        """Per node its strategy booleans (exactly one true): a representative's own, shared by the
        nodes `Problem.rep` maps to it; [1] for a node with one strategy."""
        x: list[list] = []
        for node in self.problem.nodes:
            r = self.problem.rep[node.index]
            if r != node.index:
                x.append(x[r])
            elif node.size == 1:
                x.append([1])
            else:
                vs = [self.m.NewBoolVar(f"n{node.index}_{i}") for i in range(node.size)]
                self.m.AddExactlyOne(vs)
                x.append(vs)
        return x

    def _own_costs(self) -> None:
        """Each decision's own cost per strategy, summed over the nodes sharing it (less the async
        time `overlap.add_overlap` counts)."""
        problem = self.problem
        own: dict[int, list[float]] = defaultdict(lambda: [0.0])
        for node in problem.nodes:
            acc = own.setdefault(problem.rep[node.index], [0.0] * node.size)
            hidden = node.async_s if self.overlap_on and node.ops else [0.0] * node.size
            for i, (c, a) in enumerate(zip(node.costs, hidden)):
                acc[i] += c - a
        for r, costs in own.items():
            for i, c in enumerate(costs):
                self._add_cost(self.x[r][i], c)

    def _edges(self) -> None:
        """The resharding of every edge, edges identical under `Problem.rep` once with their count as
        a multiplier; a prefetched argument's as an expression of its own (`prefetch_expr`)."""
        problem = self.problem
        merged: dict[tuple, int] = defaultdict(int)
        arguments = frozenset(problem.graph.inputs)
        for e in problem.edges:
            t = problem.priced(e.tensor, e.op)
            key = (problem.rep[e.src], problem.rep[e.dst], t, e.src_specs, e.dst_specs)
            if problem.overlap and problem.prefetch and prefetched(problem, e, arguments):
                self.prefetch_of[e.dst].append(key)
                self.prefetch_expr[key] = []
                continue
            merged[key] += 1
        for (src, dst, t, src_specs, dst_specs), mult in merged.items():
            self._edge(src, dst, t, src_specs, dst_specs, mult)
        for key, terms in self.prefetch_expr.items():  # one edge's resharding, as an expression
            self.sink = terms
            self._edge(*key, 1)
        self.sink = None

    def _ties(self) -> None:
        """Tied outputs keep their inputs' layouts; ties of repeated layers are one constraint set."""
        problem = self.problem
        tied: set[tuple] = set()
        for tin, tout in problem.ties:
            a, b = problem.owner[tin], problem.owner[tout]
            key = (problem.rep[a], problem.rep[b], tuple(problem.nodes[a].owned[tin]),
                   tuple(problem.nodes[b].owned[tout]), a == b)
            if key not in tied:
                tied.add(key)
                self._tie(tin, tout)

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
            self._vars.append(g)
            self._coeffs.append(ticks)

    def _add_cost(self, var, seconds: float) -> None:
        self.add_ticks((var,), int(round(seconds * _NS)))

    def add_ticks(self, variables, ticks: int) -> None:
        """Adds `ticks` objective units for each of `variables` (booleans, or constants 0/1), to
        the objective or, while `sink` is set, to that expression's terms."""
        if ticks == 0:
            return
        for v in variables:
            if self.sink is not None:
                self.sink.append(ticks * v)
                self.sink_ticks += ticks
            elif isinstance(v, int):
                self.constant += ticks * v
            else:
                self._vars.append(v)
                self._coeffs.append(ticks)

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
        per part). Specs with equal cost rows (keys with equal cost columns) share one row (column):
        the aggregated transportation polytope has the same LP bound with fewer booleans
        (`edge_forms.edge_form`, which groups them once per cost model).
        """
        cost = self.problem.cost
        if src == dst:
            for i, (s, r) in enumerate(zip(src_specs, dst_specs)):
                total = edge_time(t, s, r, cost)
                self._add_cost(self.x[src][i], total * mult)
            return
        xs, ys = self.x[src], self.x[dst]
        for form in edge_form(t, src_specs, dst_specs, mult, cost):
            if len(form.rows) == 1:  # the cost depends on the consumer's choice alone
                for col, idx in zip(form.ticks, form.cols):
                    self.add_ticks([ys[j] for j in idx], col[0])
                continue
            if len(form.cols) == 1:  # on the producer's alone
                (col,) = form.ticks
                for r, idx in enumerate(form.rows):
                    self.add_ticks([xs[i] for i in idx], col[r])
                continue
            n_rows, n_cols = len(form.rows), len(form.cols)
            e = [self.m.new_bool_var("") for _ in range(n_rows * n_cols)]  # e[r * n_cols + c]
            total = cp_model.LinearExpr.sum
            for r, idx in enumerate(form.rows):
                self.m.add(total(e[r * n_cols:(r + 1) * n_cols]) == total([xs[i] for i in idx]))
            for c, idx in enumerate(form.cols):
                self.m.add(total(e[c::n_cols]) == total([ys[j] for j in idx]))
            for c, col in enumerate(form.ticks):
                for r in range(n_rows):
                    self.add_ticks((e[r * n_cols + c],), col[r])

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
            if isinstance(lhs, int) and isinstance(rhs, int):  # both sides pinned (`planner.configs.pins`)
                if lhs != rhs:
                    self.m.AddBoolOr([])  # contradictory pins: infeasible
                continue
            self.m.Add(lhs == rhs)

    def memory_expr(self, point: int, choice: Sequence[int] | None = None):
        """`memory_constraints.memory_expr` of this model."""
        return memory_expr(self, point, choice)

    def solve(self, det_limit: float, wall_limit: float, workers: int, hint: Sequence[int] | None,
              lp_level: int = 1, cutoff: Callable[[], float] | None = None, gap: float = 0.0):
        """One CP-SAT run limited to `det_limit` deterministic units (and `wall_limit` seconds);
        returns (choice or None, status) and leaves the run's figures in `self.last`. `lp_level`:
        CP-SAT's `linearization_level` (see `solve`). `cutoff`: objective units, read whenever the
        solver's bound improves; once the bound exceeds it the run stops and `self.cut` holds
        (bound, cutoff). `gap`: the relative gap at which the run stops as if proven optimal."""
        solver = cp_model.CpSolver()
        self.cut = None
        if cutoff is not None:
            def on_bound(bound: float) -> None:
                limit = cutoff()
                if bound > limit and self.cut is None:
                    self.cut = (bound, limit)
                    solver.StopSearch()

            solver.best_bound_callback = on_bound
        solver.parameters.max_deterministic_time = max(0.01, det_limit)
        solver.parameters.max_time_in_seconds = max(0.1, wall_limit)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = 0
        solver.parameters.linearization_level = lp_level
        solver.parameters.relative_gap_limit = gap
        # Presolve costs more than it saves on these models: they are already compact.
        solver.parameters.cp_model_presolve = False
        # Less probing: the probing at the start of the search (level 2) adds many binary clauses
        # that the SAT inprocessing's probing then works through; level 1 skips the first, 0.1 units
        # per round caps the second (level 1 alone, or no inprocessing probing, was slower on some
        # zoo models).
        solver.parameters.cp_model_probing_level = 1
        solver.parameters.inprocessing_probing_dtime = 0.1
        if gap > 0:
            # A run that may stop at a gap needs a good plan more than a tight bound: without the
            # Gomory, MIR, zero-half and clique cuts its LP rounds are cheaper and it reaches the
            # gap sooner (WORKSPACE.md, "Figures behind the code").
            for cuts in ("add_cg_cuts", "add_mir_cuts", "add_zero_half_cuts", "add_clique_cuts"):
                setattr(solver.parameters, cuts, False)
            # Every linear constraint in the LP from the start, and no SAT inprocessing: these small
            # ILPs (the stage tables' per-layer ones) reach the gap sooner with the LP's bound whole
            # than with the clause database worked on (WORKSPACE.md, "Figures behind the code").
            solver.parameters.add_lp_constraints_lazily = False
            solver.parameters.use_sat_inprocessing = False
        if hint is not None:
            self.m.ClearHints()
            for node, i in enumerate(hint):
                if self.problem.rep[node] != node:
                    continue
                for j, v in enumerate(self.x[node]):
                    if not isinstance(v, int):
                        self.m.AddHint(v, int(i == j))
        t0 = time.perf_counter()
        status = solver.Solve(self.m)
        found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        self.last = _Run(status == cp_model.OPTIMAL, solver.ObjectiveValue() if found else None,
                         solver.BestObjectiveBound(), solver.response_proto.deterministic_time,
                         time.perf_counter() - t0)
        if not found:
            return None, status
        choice = []
        for vs in self.x:
            choice.append(next(i for i, v in enumerate(vs) if isinstance(v, int) and v == 1 or
                               not isinstance(v, int) and solver.BooleanValue(v)))
        return tuple(choice), status


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """Figures of one CP-SAT run: proven optimal, objective and best bound (model units), time."""

    optimal: bool
    objective: float | None
    bound: float
    deterministic_time: float
    wall_s: float

    def gap(self) -> float | None:
        """(objective - bound) / objective: 0 when proven optimal; up to the run's `gap` when it
        stopped there (CP-SAT then reports it optimal)."""
        if self.objective is not None and np.isfinite(self.bound):
            return max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1.0))
        return 0.0 if self.optimal else None


def _status_words(status) -> str:
    """A CP-SAT status as the user reads it (never the raw status name)."""
    if status == cp_model.INFEASIBLE:
        return "no plan satisfies the constraints"
    if status == cp_model.MODEL_INVALID:
        return "the planner built an invalid solver model (a planner bug: please report it with the program)"
    return "the solver found no plan within its limit"
