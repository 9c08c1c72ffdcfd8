"""The intra-op ILP, solved with OR-tools CP-SAT.

Variables: one boolean per (node, strategy), exactly one true per node. Objective: each node's own
cost (compute + its collectives) plus the resharding cost of every edge. Resharding is costed per
part (`strategies.edge_parts`: each mesh axis, and each group of axes gathered together), so an
edge needs O(strategies x parts) auxiliary booleans instead of the O(strategies^2) of a pairwise
table; the sum over parts is the same number the pairwise table would hold (`strategies.edge_time`).
The memory budget is enforced lazily: solve, measure the plan's liveness peak, add a constraint at
each violated program point, solve again.

Limits are in CP-SAT's deterministic time (`max_deterministic_time`), so the same problem gives the
same plan on an idle or a loaded machine even when the limit stops the search (with one worker;
several workers race and are not deterministic). `time_limit` is in deterministic units: measured
here, one unit is about one second of one core (gpt-tiny 2x4: 4.75 units in 5.7 s, llama-tiny
2x4: 5.8 units in 8.5 s), so `PlanOptions.solver_time_limit` keeps its meaning in seconds on an
idle core. A wall-clock cap (`WALL_CAP_FACTOR` times the limit plus `WALL_CAP_FLOOR_S` seconds)
stops a solve on a machine so loaded that the deterministic limit would take far longer; a plan
stopped by it says so (`Solution.limit`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import numpy as np
from ortools.sat.python import cp_model

from planner.core.errors import InfeasiblePlanError, OutboundError, PlannerError
from planner.graph.trace import Graph
from planner.ilp.objective import offload_start, overlap_order, prefetched, step_time
from planner.ilp.problem import Problem, kept_in_fusion, tandem_runs
from planner.ilp.strategies import edge_parts, edge_time, part_key, part_time, shard_bytes
from planner.core.sharding import num_shards
from planner.core.units import format_bytes

log = logging.getLogger("planner")

_NS = 1e11  # objective unit: 10 picoseconds
_MEM_UNIT = 1  # memory constraint unit: bytes (KiB rounding made a plan at the minimum look infeasible)
WALL_CAP_FACTOR = 4.0  # wall-clock safety cap: this multiple of the deterministic limit ...
WALL_CAP_FLOOR_S = 10.0  # ... plus this many seconds (short limits are not left to scheduling noise)
MIN_MEMORY_LIMIT = 10.0  # deterministic units the minimum-memory search may spend at most
# `solve(beat=...)` stops only when the bound exceeds the time to beat by this fraction: the objective
# sums terms rounded to whole ticks, so it and `plan_cost` may differ by a few ticks per term.
_BEAT_MARGIN = 1e-6


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
      optimal: CP-SAT proved the plan optimal (under the memory constraints it was given).
      gap: relative gap (objective - best bound) / objective of the last solve; 0 when proven
        optimal, None when the solver gave no bound.
      deterministic_time: CP-SAT deterministic time spent, all rounds together.
      limit: which limit stopped the search: None, "deterministic" or "wall-clock" (the plan then
        depends on the machine's load).
      unbudgeted: when the budget bound (the first round's plan broke it), (step seconds, peak
        bytes, strategies ruled out) of that plan, found with no constraint on live memory but
        without the strategies the memory bound rules out (`over_budget_strategies`, their count):
        what the budget's constraints cost in time.
    """

    choice: tuple[int, ...]
    objective_s: float
    status: str
    solve_time_s: float
    peak_memory_bytes: int
    rounds: int
    optimal: bool = False
    gap: float | None = None
    deterministic_time: float = 0.0
    limit: str | None = None
    unbudgeted: tuple[float, int, int] | None = None


def memory_profile(problem: Problem, choice: Sequence[int]) -> np.ndarray:
    """Per-device bytes live at each program point under `choice`.

    Point k+1 is "while op k runs". Counted, in this one model that `memory_lower_bound` and the
    ILP's `_Model.memory_expr` also follow:
      - every tensor a node decides, in its planned layout, from its producer to its last use
        (arguments and outputs: `problem.live`), except values of the optimizer update that XLA
        keeps inside one fusion (`_materialised`);
      - each operand in the layout its consumer reads it in, at the consumer (a resharded copy is
        a real transient buffer; when no resharding happens this double-counts one op's operands, a
        deliberate safety margin), except where `_copied_only_if_resharded`: a pinned output
        handed back and the operands of the optimizer update count only when resharded, at the
        last point (`_transient_point`);
      - on XLA:CPU, the buffers its reductions allocate (`_reduction_buffers`), and one more point
        after the end (index n+2): XLA's own accounting while the combined gradient reduction runs
        (`_reserved_point`);
      - on XLA:CPU, program outputs not yet written whose buffers hold no temporary (`_borrowed`;
        the count above, the liveness count, lets any temporary use them).
    Checked against XLA's compiled `memory_analysis()` (experiments/check_memory.py,
    tests/test_memory.py).
    """
    profile = _liveness_profile(problem, choice)
    extra = _borrowed(problem, choice, profile)[0]
    profile[: len(extra)] += extra
    return profile


def _liveness_profile(problem: Problem, choice: Sequence[int]) -> np.ndarray:
    """`memory_profile` without XLA:CPU's output buffers (`_borrowed`): the liveness count."""
    n = len(problem.graph.ops)
    delta = np.zeros(n + 3, dtype=np.int64)
    mesh = problem.cost.mesh
    for tid, (first, last) in enumerate(problem.live):
        if not _materialised(problem, tid, first):
            continue
        b = shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
        delta[first + 1] += b
        delta[last + 2] -= b
    combined_at = _combined_point(problem)
    for node in problem.nodes:
        for first, last, b in _reduction_buffers(problem, node, choice[node.index], combined_at):
            delta[first] += b
            delta[last + 1] -= b
    profile = np.cumsum(delta)[: n + 2]
    for tid, op in problem.host_reads:  # a host-kept argument copied in for one op (`Problem.host_reads`)
        profile[op + 1] += shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
    for e in problem.edges:
        at = _transient_point(problem, e)
        if _copied_only_if_resharded(problem, e) and e.src_specs[choice[e.src]] == e.dst_specs[choice[e.dst]]:
            continue  # a pinned output or an update operand already in its layout: no copy
        b = shard_bytes(problem.graph.tensors[e.tensor], e.dst_specs[choice[e.dst]], mesh)
        profile[at] += b
    reserved = sum(shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
                   for tid, (first, last) in enumerate(problem.live) if last == n and _materialised(problem, tid, first))
    reserved += sum(_unfit_buffers(problem, node, choice[node.index]) for node in problem.nodes)
    return np.append(profile, reserved if _xla_cpu(problem) else 0)


def _materialised(problem: Problem, tid: int, first: int) -> bool:
    """Whether tensor `tid` (made by op `first`) takes memory of its own: a decided tensor, unless
    XLA keeps it inside a fusion (`problem.kept_in_fusion`): on XLA:GPU any such value, on XLA:CPU
    only the optimizer update's (the combinable tail). optax computes
    each step of the update for every leaf before the next step (all m-hat, then all v-hat, ...),
    so in program order such values of every leaf are live at once, while XLA fuses each leaf's
    elementwise update into one loop and never writes them (counting them put gpt-tiny's and
    moe-tiny's data-parallel predictions at 1.12-1.13x of the compiled peak), and a residual XLA:CPU
    recomputes in the backward's fusion (`problem.recomputed`, `fusion.recomputed`). Elsewhere on
    XLA:CPU values kept inside fusions still count: dropping them everywhere gave wresnet-tiny 0.68x."""
    return tid in problem.owner and not kept_in_fusion(tid, first, problem.unwritten, problem.combinable,
                                                         problem.memory_platform, problem.recomputed)


def _copied_only_if_resharded(problem: Problem, e) -> bool:
    """Edges whose operand copy exists only when the layouts differ: a pinned output resharded at
    the end, and the operands of the optimizer update (the combinable tail): XLA reads an update
    operand already in its layout in place. (Counting every update operand as a copy predicted
    1.6-1.9x of XLA's compiled peak on the zoo models.) On XLA:GPU every edge: an operand read in its
    layout is read in place (counting a copy at every consumer put the unsharded gpt2-small at 1.13x
    of the peak XLA compiled for an H100, the 1.65 GB logits gradient counted twice;
    experiments/check_gpu.py)."""
    return True


def _transient_point(problem: Problem, e) -> int:
    """Where an edge's operand copy is counted: at its consumer, except in the combinable tail of
    the program (the optimizer update), where XLA's combiners gather every resharded operand into
    one buffer that lives until the end; those all count at the last point."""
    if e.op < 0 or e.op in problem.combinable:  # op -1: a pinned output resharded at the end
        return len(problem.graph.ops) + 1
    return e.op + 1


_REDUCTIONS = ("all-reduce", "reduce-scatter")


def _unfit_buffers(problem: Problem, node, i: int) -> int:
    """Bytes of `node`'s XLA:CPU reduction buffers (strategy `i`) that cannot borrow an output's
    buffer at the combined gradient reduction: the operand and full-size result of each
    reduce-scatter, each n times the size of the shard the output keeps.

    XLA reports a program's peak as arguments + outputs + temporaries (`memory_analysis()`): an
    output's buffer is reserved for the whole program, and a temporary may use it before the output
    is written only if it fits (buffer assignment). Data-parallel gradients have their outputs'
    shapes and fit; the buffers of a scattered gradient are larger than its outputs' shards
    (gpt-tiny on 1x8 under a budget: 1.09 MB live at the combined all-reduce, 1.39 MB of outputs
    and temporaries reported). The extra point of `memory_profile` counts arguments, all outputs
    and these buffers (`_reserved_point`); it ignores that such a buffer may borrow another, larger
    output's buffer (an over-estimate)."""
    if not _xla_cpu(problem):
        return 0
    return sum(2 * nbytes for (kind, _, nbytes), o in zip(node.comms[i], node.comm_ops[i])
               if kind == "reduce-scatter" and o in problem.combinable)


def _reserved_point(problem: Problem) -> int:
    """Index of `memory_profile`'s extra point: XLA:CPU's accounting while the combined gradient
    reduction runs (all arguments and outputs, plus `_unfit_buffers`; 0 on other platforms)."""
    return len(problem.graph.ops) + 2


def _xla_cpu(problem: Problem) -> bool:
    """The plan compiles for XLA:CPU: the mesh's devices are CPUs, or (planning without devices)
    the hardware preset is a CPU."""
    return problem.memory_platform == "cpu"


def _output_slots(problem: Problem, choice: Sequence[int]) -> tuple[list[tuple[int, int, int, tuple]],
                                                                    list[tuple[int, int]]]:
    """XLA:CPU's program-output buffers and the temporaries that may borrow them, under `choice`
    (`_borrowed`): (temporaries as (first point, last point, bytes, key)), (outputs as (the first
    point they are written at, bytes)), in `memory_profile`'s points. A key names the term of
    `_Model.memory_expr` the temporary is: ("t", tensor id), ("e", edge index) or ("r", node,
    strategy, bytes) for a reduction buffer. Arguments are not temporaries; a donated argument's
    output is not a free buffer (its argument holds it until its last read, `live_ranges`)."""
    mesh = problem.cost.mesh
    n = len(problem.graph.ops)
    donated_outputs = {tout for _, tout in problem.donated}
    outputs = {x for x in problem.graph.outputs if isinstance(x, int)}
    temps: list[tuple[int, int, int, tuple]] = []
    slots: list[tuple[int, int]] = []
    for tid, (first, last) in enumerate(problem.live):
        if first < 0 or not _materialised(problem, tid, first):
            continue
        b = shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
        if tid in outputs and last == n:
            if tid not in donated_outputs:
                slots.append((first + 1, b))
        elif b:
            temps.append((first + 1, last + 1, b, ("t", tid)))
    for k, e in enumerate(problem.edges):
        if _copied_only_if_resharded(problem, e) and e.src_specs[choice[e.src]] == e.dst_specs[choice[e.dst]]:
            continue
        at = _transient_point(problem, e)
        b = shard_bytes(problem.graph.tensors[e.tensor], e.dst_specs[choice[e.dst]], mesh)
        if b:
            temps.append((at, at, b, ("e", k)))
    combined_at = _combined_point(problem)
    for node in problem.nodes:
        i = choice[node.index]
        for first, last, b in _reduction_buffers(problem, node, i, combined_at):
            temps.append((first, last, b, ("r", node.index, i, b)))
    return temps, slots


def _borrowed(problem: Problem, choice: Sequence[int],
              liveness: np.ndarray | None = None) -> tuple[np.ndarray, dict[int, list[tuple]], frozenset[int]]:
    """What XLA:CPU's output buffers hold before they are written, under `choice`: per point of
    `memory_profile` (0..n+1) the bytes of unwritten outputs that hold no temporary; per point the
    keys of the temporaries they hold (`_output_slots`); the points where both were worked out.

    XLA reserves a program output's buffer for the whole program (`memory_analysis()` reports
    arguments + outputs + temporaries) and places a temporary in it only when the temporary fits,
    one at a time (buffer assignment's `MaybeAssignBuffer`; read from llama-tiny's buffer
    assignment with `--xla_dump_to`: a 64 KB output's allocation held 19 temporaries of 0.1-64 KB,
    each alone at offset 0). The liveness count (`_liveness_profile`) counts an output from its
    write, so it lets every live temporary use every unwritten output's bytes; this is the rest:
    at each point the live temporaries, largest first, each take a free unwritten output they fit
    in (the most bytes any one-per-buffer placement holds), and the unwritten outputs' bytes left
    over count as well (experiments/check_memory.py: llama-tiny 2x4 0.896 -> 1.003 of the compiled
    peak, every zoo row within 0.97-1.09).

    Worked out only where it can matter: a point whose liveness count plus all its unwritten
    outputs' bytes cannot exceed the highest point worked out (or the liveness peak) keeps its
    liveness count, below the profile's peak (0.44 s -> a fraction for gpt2-small's 6.8k points on
    2x4). Other platforms: zeros (a GPU's buffer assignment has not been read here)."""
    n = len(problem.graph.ops)
    if not _xla_cpu(problem):
        return np.zeros(n + 2, dtype=np.int64), {}, frozenset()
    cached = problem._borrowed.get("last")
    if cached is not None and cached[0] == tuple(choice):
        return cached[1]
    if liveness is None:
        liveness = _liveness_profile(problem, choice)
    extra = np.zeros(n + 2, dtype=np.int64)
    held: dict[int, list[tuple]] = {}
    done: set[int] = set()
    temps, slots = _output_slots(problem, choice)
    if slots:
        write = np.array([w for w, _ in slots], dtype=np.int64)
        size = np.array([b for _, b in slots], dtype=np.int64)
        unwritten = np.zeros(n + 3, dtype=np.int64)  # bytes of outputs not written at each point
        np.add.at(unwritten, np.minimum(write, n + 2), size)
        unwritten = np.cumsum(unwritten[::-1])[::-1][1:n + 3]
        first = np.array([f for f, _, _, _ in temps], dtype=np.int64)
        last = np.array([l for _, l, _, _ in temps], dtype=np.int64)
        tbytes = np.array([b for _, _, b, _ in temps], dtype=np.int64)
        order = np.argsort(-tbytes, kind="stable")  # temporaries largest first, once
        first, last, tbytes = first[order], last[order], tbytes[order]
        keys = [temps[k][3] for k in order]
        upper = liveness[: n + 2] + unwritten
        best = int(liveness.max())
        for point in np.argsort(-upper, kind="stable"):
            if upper[point] <= best or not unwritten[point]:
                break
            point = int(point)
            free = np.sort(size[write > point])
            live = np.nonzero((first <= point) & (last >= point))[0]
            s = tbytes[live]
            # fits[i]: outputs at least as large as temporary i; taking temporaries largest first,
            # the i-th (1-based) finds a free one iff fewer than fits[i] were taken: taken after i is
            # i + min(0, min over j <= i of (fits[j] - j)) (fits only grows along the order)
            fits = len(free) - np.searchsorted(free, s, side="left")
            steps = np.arange(1, len(s) + 1)
            taken = steps + np.minimum(0, np.minimum.accumulate(fits - steps)) if len(s) else steps
            took = np.diff(taken, prepend=0) > 0
            extra[point] = int(free.sum()) - int(s[took].sum())
            held[point] = [keys[k] for k in live[took]]
            done.add(point)
            best = max(best, int(liveness[point]) + int(extra[point]))
    found = extra, held, frozenset(done)
    problem._borrowed["last"] = (tuple(choice), found)
    return found


def _combined_point(problem: Problem) -> int:
    """The program point where XLA's combiner runs the gradient reductions as one collective: after
    the last combinable op that reduces partial sums under some strategy (a fixed point, so the
    ILP's constraints stay linear). Approximation: a reduction that depends on another one (a
    global gradient norm) cannot join that collective; it moves this point later."""
    last = max((o for node in problem.nodes for comms, ops in zip(node.comms, node.comm_ops)
                for (kind, _, _), o in zip(comms, ops) if kind in _REDUCTIONS and o in problem.combinable),
               default=-1)
    return last + 1


def _reduction_buffers(problem: Problem, node, i: int, combined_at: int) -> list[tuple[int, int, int]]:
    """(first point, last point, bytes) of the buffers XLA:CPU allocates for the partial-sum
    reductions of `node` under strategy `i` beyond the tensors the model already counts. Read from
    XLA:CPU's buffer assignment (`--xla_dump_to`, experiments/check_memory.py):
      - its all-reduce does not run in place: the partial sums (the operand, `nbytes`) and the
        reduced result are separate buffers, both live while it runs (the result is the node's
        tensor, counted already);
      - it has no reduce-scatter: a reduce-scatter compiles to an all-reduce of the whole partial
        sums and a slice, so the operand and a full-size result (2 x `nbytes`) are live beside the
        slice (the node's tensor);
      - the gradient reductions (combinable ops) are merged into one all-reduce that runs once all
        of them are computed (`_combined_point`), so each one's partial sums live from its op to
        that point, and the full-size results of reduce-scatters are live there together.
    Other platforms: none (XLA:GPU/TPU have a reduce-scatter; not measured here)."""
    if not _xla_cpu(problem):
        return []
    out = []
    for (kind, _, nbytes), o in zip(node.comms[i], node.comm_ops[i]):
        if kind not in _REDUCTIONS or not nbytes:
            continue
        if o in problem.combinable:
            out.append((o + 1, combined_at, nbytes))
            if kind == "reduce-scatter":
                out.append((combined_at, combined_at, nbytes))
        else:
            out.append((o + 1, o + 1, 2 * nbytes if kind == "reduce-scatter" else nbytes))
    return out


def _compute_ticks(node) -> tuple[int, ...]:
    """Per strategy, the node's compute (its cost less its own collectives) in objective units."""
    return tuple(int(round((c - m) * _NS)) for c, m in zip(node.costs, node.comm_s))


def _lin(x, ticks):
    return sum(t * v for t, v in zip(ticks, x) if t)


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
        self._sink: list | None = None  # while set, `_add_ticks` collects terms there (`_prefetch`)
        self._sink_ticks = 0  # the sum of every coefficient collected there (a bound on their value)
        self._part_times: dict = {}
        # With overlap, the combinable collectives' async time leaves the node costs; `_overlap`
        # adds back its exposed part.
        self._overlap_on = problem.overlap and any(t > 0 for n in problem.nodes for t in n.async_s)
        own: dict[int, list[float]] = defaultdict(lambda: [0.0])
        for node in problem.nodes:
            acc = own.setdefault(problem.rep[node.index], [0.0] * node.size)
            hidden = node.async_s if self._overlap_on and node.ops else [0.0] * node.size
            for i, (c, a) in enumerate(zip(node.costs, hidden)):
                acc[i] += c - a
        for r, costs in own.items():
            for i, c in enumerate(costs):
                self._add_cost(self.x[r][i], c)
        merged: dict[tuple, int] = defaultdict(int)
        # With overlap, resharding an argument for its consumer (`objective.prefetched`) leaves the
        # objective; `_prefetch` adds back the part not hidden behind earlier compute.
        self._prefetch_expr: dict[tuple, list] = {}
        self._prefetch_of: dict[int, list[tuple]] = defaultdict(list)
        arguments = frozenset(problem.graph.inputs)
        for e in problem.edges:
            t = problem.graph.tensors[e.tensor]
            key = (problem.rep[e.src], problem.rep[e.dst], t, e.src_specs, e.dst_specs)
            if problem.overlap and problem.prefetch and prefetched(problem, e, arguments):
                self._prefetch_of[e.dst].append(key)
                self._prefetch_expr[key] = []
                continue
            merged[key] += 1
        for (src, dst, t, src_specs, dst_specs), mult in merged.items():
            self._edge(src, dst, t, src_specs, dst_specs, mult)
        for key, terms in self._prefetch_expr.items():  # one edge's resharding, as an expression
            self._sink = terms
            self._edge(*key, 1)
        self._sink = None
        self._combined_latency()
        self._overlap()
        self._prefetch()
        self._offload()
        tied: set[tuple] = set()
        for tin, tout in problem.ties:  # ties of repeated layers are one constraint set
            a, b = problem.owner[tin], problem.owner[tout]
            key = (problem.rep[a], problem.rep[b], tuple(problem.nodes[a].owned[tin]),
                   tuple(problem.nodes[b].owned[tout]), a == b)
            if key not in tied:
                tied.add(key)
                self._tie(tin, tout)
        self.objective = sum(self.terms) + self.constant
        self.copies: dict = {}  # (edge key, consumer spec) -> "operand copied" boolean (`_copy_var`)
        self.sizes: dict = {}  # tensor id or -1 - edge index -> bytes per spec (`_sizes`)
        self.reductions: list | None = None  # (node, strategy, first, last point, bytes): `_reduction_buffers`

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
        """Adds the combinable collectives' exposed part (`objective.hidden_time`; their async time
        itself is taken out of the node costs in `__init__`).

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
        whatever L is; runs are found by `problem.tandem_runs` on the nodes' (shared decision,
        compute, async) sequence, and any cut of the sequence gives the same value. Every
        constraint bounds a variable from below by an expression increasing in the variables
        before it, so the minimum holds E at the exact value for the chosen strategies.
        """
        p = self.problem
        if not self._overlap_on:
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
                x = self.x[node.index]
                info.append((_lin(x, compute), _lin(x, issued) if any(issued) else None))
            seq.append(ids[key])
        self.terms.append(self._backlog(seq, info, bound))

    def _prefetch(self) -> None:
        """Adds the exposed part of the arguments' resharding (`objective.prefetch_hidden`): issued
        in order of their consumers from the start of the step on one link, each needed before its
        consumer computes. The stall max over k of (prefetch up to k - compute before k) is the
        backlog of the same first-in-first-out recursion as `_overlap` run over the nodes in
        reverse program order, each node issuing its consumers' prefetch after its compute."""
        p = self.problem
        if not self._prefetch_expr:
            return
        ids: dict[tuple, int] = {}
        seq: list[int] = []
        info: list[tuple] = []
        bound = 1 + self._sink_ticks * max(1, len(self._prefetch_of))
        for node in reversed(overlap_order(p)):
            compute = _compute_ticks(node)
            bound += int(max(node.costs) * _NS) + 1
            keys = tuple(sorted(self._prefetch_of.get(node.index, ()), key=repr))
            if not any(compute) and not keys:
                continue
            key = (p.rep[node.index], compute, keys)
            if key not in ids:
                ids[key] = len(info)
                issued = sum(sum(self._prefetch_expr[k]) for k in keys) if keys else None
                info.append((_lin(self.x[node.index], compute), issued))
            seq.append(ids[key])
        self.terms.append(self._backlog(seq, info, bound))

    def _offload(self) -> None:
        """Adds the host-offload copies (`objective.offload_transfer`, `offload_hidden`): the copies
        back in full; the copies in in full without overlap, else max(0, copies in - compute before
        `objective.offload_start`) in one integer variable (minimised, so exact)."""
        p = self.problem
        if not p.offloaded:
            return
        bandwidth = p.cost.hardware.host_bandwidth
        copy_in: dict[tuple[int, int], int] = defaultdict(int)
        reads = Counter(t for t, _ in p.host_reads)  # copies in before the update (`Problem.host_reads`)
        for tin, tout in p.offloaded:
            node = p.nodes[p.owner[tin]]
            for i, spec in enumerate(node.owned[tin]):
                ticks = int(round(shard_bytes(p.graph.tensors[tin], spec, p.cost.mesh) / bandwidth * _NS))
                copy_in[(node.index, i)] += ticks * (1 + reads[tin])
                if tout >= 0:
                    self._add_ticks((self.x[node.index][i],), ticks)
        if not p.overlap or p.graph.update_groups or p.host_reads:  # exposed (`objective.offload_hidden`)
            for (n, i), ticks in copy_in.items():
                self._add_ticks((self.x[n][i],), ticks)
            return
        start = offload_start(p)
        before: dict[tuple[int, int], int] = defaultdict(int)
        for node in overlap_order(p):
            if node.ops[0] >= start:
                break
            for i, t in enumerate(_compute_ticks(node)):
                before[(node.index, i)] += t
        exposed = self.m.NewIntVar(0, sum(copy_in.values()) + 1, "exposed_offload")
        self.m.Add(exposed >= sum(t * self.x[n][i] for (n, i), t in copy_in.items())
                   - sum(t * self.x[n][i] for (n, i), t in before.items() if t))
        self.terms.append(exposed)

    def _backlog(self, seq: list[int], info: list[tuple], bound: int):
        """The exposed backlog (an integer variable, objective units) of a first-in-first-out stream
        over `seq` (ids into `info`: per item its compute expression and its issued expression, or
        None when it issues nothing), in max-plus form; see `_overlap`."""

        def chain(state, items):
            """The backlog after `items` (key ids) from `state` (None: -inf), one variable per issue."""
            for k in items:
                compute, a = info[k]
                if a is None:
                    state = None if state is None else state - compute
                    continue
                b = self.m.NewIntVar(0, bound, "")
                self.m.Add(b >= a)
                if state is not None:
                    self.m.Add(b >= a + state - compute)
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
            r = self.m.NewIntVar(-bound, bound, "")
            self.m.Add(r >= alpha)
            self.m.Add(r >= alpha + (repeats - 1) * beta)
            if state is not None:
                self.m.Add(r >= state + repeats * beta)
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
        exposed = self.m.NewIntVar(0, bound, "exposed_async")
        if state is not None:
            self.m.Add(exposed >= state)
        return exposed

    def _add_cost(self, var, seconds: float) -> None:
        self._add_ticks((var,), int(round(seconds * _NS)))

    def _add_ticks(self, variables, ticks: int) -> None:
        """Adds `ticks` objective units for each of `variables` (booleans, or constants 0/1), to
        the objective or, while `_sink` is set, to that expression's terms."""
        if ticks == 0:
            return
        for v in variables:
            if self._sink is not None:
                self._sink.append(ticks * v)
                self._sink_ticks += ticks
            elif isinstance(v, int):
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
            ticks = {s: tuple(int(round(self._part_time(t, s, part, q) * mult * _NS)) for q in keys) for s in by_src}
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

    def _part_time(self, t, src, part, key) -> float:
        """`strategies.part_time`, computed once per distinct question."""
        k = (t, src, part, key)
        found = self._part_times.get(k)
        if found is None:
            found = self._part_times[k] = part_time(t, src, part, key, self.problem.cost)
        return found

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
        """Per-device bytes live at program point `point`, as a linear expression of the choice:
        `memory_profile`'s count term by term (tests/test_memory.py compares them).

        `memory_profile`'s XLA:CPU output buffers (`_borrowed`) depend on which temporaries fit
        which unwritten output, which no linear expression says; with `choice` (the plan whose peak
        broke the budget there) the expression counts every output not yet written at `point` and
        leaves out the temporaries that plan's unwritten outputs hold, so it equals the profile at
        `choice` and holds those temporaries in those buffers for every other plan. Without it, the
        liveness count alone (every unwritten output's bytes free for any temporary: a lower bound
        of the profile, which `memory_lower_bound` also follows)."""
        p = self.problem
        coef: dict[tuple[int, int], int] = defaultdict(int)
        copies: dict = defaultdict(int)
        if choice is not None and point < _reserved_point(p) and _xla_cpu(p):
            self._borrowed_terms(point, choice, coef, copies)
        if point == _reserved_point(p):
            if not _xla_cpu(p):
                return 0
            n = len(p.graph.ops)
            for tid, (first, last) in enumerate(p.live):
                if last == n and _materialised(p, tid, first):
                    node = p.nodes[p.owner[tid]]
                    for i, b in enumerate(self._sizes(tid, tid, node.owned[tid])):
                        coef[(p.rep[node.index], i)] += b
            for node in p.nodes:
                for i in range(node.size):
                    coef[(p.rep[node.index], i)] += _unfit_buffers(p, node, i)
            return sum(-(-c // _MEM_UNIT) * self.x[n][i] for (n, i), c in coef.items() if c)
        for tid, (first, last) in enumerate(p.live):
            if not (first < point <= last + 1) or not _materialised(p, tid, first):
                continue
            node = p.nodes[p.owner[tid]]
            for i, b in enumerate(self._sizes(tid, tid, node.owned[tid])):
                coef[(p.rep[node.index], i)] += b
        for tid, op in p.host_reads:  # a host-kept argument copied in for one op
            if op + 1 == point:
                node = p.nodes[p.owner[tid]]
                for i, b in enumerate(self._sizes(tid, tid, node.owned[tid])):
                    coef[(p.rep[node.index], i)] += b
        for k, e in enumerate(p.edges):  # operands as the op reads them (a resharded copy is a transient buffer)
            if _transient_point(p, e) == point:
                for j, b in enumerate(self._sizes(-1 - k, e.tensor, e.dst_specs)):
                    if _copied_only_if_resharded(p, e):  # only when resharded (`memory_profile`)
                        copies[self._copy_var(e, j)] += b
                    else:
                        coef[(p.rep[e.dst], j)] += b
        if self.reductions is None:
            combined_at = _combined_point(p)
            self.reductions = [(p.rep[node.index], i, first, last, b) for node in p.nodes for i in range(node.size)
                               for first, last, b in _reduction_buffers(p, node, i, combined_at)]
        for n, i, first, last, b in self.reductions:  # XLA:CPU's reduction buffers
            if first <= point <= last:
                coef[(n, i)] += b
        return (sum(-(-c // _MEM_UNIT) * self.x[n][i] for (n, i), c in coef.items() if c)
                + sum(-(-c // _MEM_UNIT) * z for z, c in copies.items() if c and (not isinstance(z, int) or z)))

    def _borrowed_terms(self, point: int, choice: Sequence[int], coef: dict, copies: dict) -> None:
        """Adds to `memory_expr`'s terms at `point` every output not yet written there and takes
        away the temporaries `choice`'s unwritten outputs hold (`_borrowed`)."""
        p = self.problem
        _, held, done = _borrowed(p, choice)
        if point not in done:
            return
        n = len(p.graph.ops)
        donated_outputs = {tout for _, tout in p.donated}
        for tid in {x for x in p.graph.outputs if isinstance(x, int)} - donated_outputs:
            first, last = p.live[tid]
            if last == n and first + 1 > point and _materialised(p, tid, first):
                node = p.nodes[p.owner[tid]]
                for i, b in enumerate(self._sizes(tid, tid, node.owned[tid])):
                    coef[(p.rep[node.index], i)] += b
        for key in held.get(point, ()):
            if key[0] == "t":
                node = p.nodes[p.owner[key[1]]]
                for i, b in enumerate(self._sizes(key[1], key[1], node.owned[key[1]])):
                    coef[(p.rep[node.index], i)] -= b
            elif key[0] == "e":
                e = p.edges[key[1]]
                for j, b in enumerate(self._sizes(-1 - key[1], e.tensor, e.dst_specs)):
                    if _copied_only_if_resharded(p, e):
                        copies[self._copy_var(e, j)] -= b
                    else:
                        coef[(p.rep[e.dst], j)] -= b
            else:  # a reduction buffer of node key[1] under its strategy key[2]
                coef[(p.rep[key[1]], key[2])] -= key[3]

    def _sizes(self, key: int, tid: int, specs) -> list[int]:
        """Per-device bytes of tensor `tid` in each of `specs` (`key`: the tensor's id for the specs
        its owner gives it, -1 - k for edge k's consumer specs), computed once per model: each
        memory round and the minimum-peak search ask for the same tensors at several points."""
        found = self.sizes.get(key)
        if found is None:
            t = self.problem.graph.tensors[tid]
            found = self.sizes[key] = [shard_bytes(t, spec, self.problem.cost.mesh) for spec in specs]
        return found

    def _copy_var(self, e, j: int):
        """A boolean that is 1 when the consumer of edge `e` reads it in its spec `j` and the
        producer's spec differs (z >= x_dst[j] - sum of the producer's indicators of that spec;
        minimised by the memory bound, so it is exactly the copy indicator where it matters)."""
        p = self.problem
        key = (p.rep[e.src], p.rep[e.dst], e.src_specs, e.dst_specs, j)
        if key not in self.copies:
            same = sum(self.x[e.src][i] for i, s in enumerate(e.src_specs) if s == e.dst_specs[j])
            need = self.x[e.dst][j] - same
            if isinstance(need, int):
                self.copies[key] = max(0, need)
            else:
                z = self.m.NewBoolVar("")
                self.m.Add(z >= need)
                self.copies[key] = z
        return self.copies[key]

    def solve(self, det_limit: float, wall_limit: float, workers: int, hint: Sequence[int] | None,
              lp_level: int = 1, cutoff: Callable[[], float] | None = None):
        """One CP-SAT run limited to `det_limit` deterministic units (and `wall_limit` seconds);
        returns (choice or None, status) and leaves the run's figures in `self.last`. `lp_level`:
        CP-SAT's `linearization_level` (see `solve`). `cutoff`: objective units, read whenever the
        solver's bound improves; once the bound exceeds it the run stops and `self.cut` holds
        (bound, cutoff)."""
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
        # Presolve costs more than it saves on these models (measured: 11.8 s -> 5.5 s for gpt-tiny
        # on 2x4, 14.6 s -> 9.0 s for gpt2-small, same optimum): the model is already compact.
        solver.parameters.cp_model_presolve = False
        # Less probing. The probing at the start of the search (level 2) spends about one
        # deterministic unit and adds ~1.4M binary clauses to gpt2-small's 2x4 model, and the SAT
        # inprocessing's probing (1 unit per round by default) then works through them; level 1
        # skips the first, 0.1 units per round caps the second. Measured with ortools 9.15, one
        # worker, deterministic units, the same optimum on each (default -> these): gpt2-small 2x4
        # 3.91 -> 1.18, 1x8 0.27 -> 0.15; gpt-tiny 2x4 4.61 -> 1.98; llama-tiny 2x4 5.57 -> 2.46;
        # moe-tiny 2x4 5.82 -> 3.03; wresnet-tiny 2x4 1.64 -> 0.74; bert-base 2x4 4.83 -> 1.73;
        # gpt2-medium 4x4 7.01 -> 4.78; llama-7b 8x8 5.62 -> 5.29. Level 1 alone slowed gpt2-medium
        # 4x4 (10.06); no inprocessing probing at all slowed gpt-tiny 2x4 (4.34).
        solver.parameters.cp_model_probing_level = 1
        solver.parameters.inprocessing_probing_dtime = 0.1
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
        if self.optimal:
            return 0.0
        if self.objective is None or not np.isfinite(self.bound):
            return None
        return max(0.0, (self.objective - self.bound) / max(abs(self.objective), 1.0))


def _status_words(status) -> str:
    """A CP-SAT status as the user reads it (never the raw status name)."""
    if status == cp_model.INFEASIBLE:
        return "no plan satisfies the constraints"
    if status == cp_model.MODEL_INVALID:
        return "the planner built an invalid solver model (a planner bug: please report it with the program)"
    return "the solver found no plan within its limit"


def _in_program_order(problem: Problem, pick) -> tuple[int, ...]:
    """One strategy per distinct decision, nodes in program order: `pick(node, allowed, choice,
    done)` chooses for each representative node, where `allowed` are its strategies that keep tied
    outputs equal to inputs already chosen (possibly none); shared nodes copy their representative."""
    choice = [0] * len(problem.nodes)
    rep = problem.rep
    tied_out: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # by the decision of the output
    reachable: dict[int, list[tuple[int, int, set]]] = defaultdict(list)  # tied inputs: specs their outputs take
    for tin, tout in problem.ties:
        a, b = problem.owner[tin], problem.owner[tout]
        tied_out[rep[b]].append((tin, tout, b))
        reachable[rep[a]].append((tin, a, set(problem.nodes[b].owned[tout])))
    done: set[int] = set()
    for node in problem.nodes:
        r = rep[node.index]
        if r in done:
            choice[node.index] = choice[r]
            continue
        # Every node sharing this decision keeps its tied outputs equal to inputs already chosen,
        # and gives its tied inputs only specs their outputs can take.
        allowed = [i for i in range(node.size)
                   if not any(rep[problem.owner[tin]] in done
                              and problem.nodes[owner].owned[tout][i]
                              != problem.nodes[problem.owner[tin]].owned[tin][choice[rep[problem.owner[tin]]]]
                              for tin, tout, owner in tied_out[r])
                   and all(problem.nodes[owner].owned[tin][i] in specs for tin, owner, specs in reachable[r])]
        choice[node.index] = pick(node, allowed, choice, done)
        done.add(node.index)
    return tuple(choice)


def greedy(problem: Problem) -> tuple[int, ...]:
    """A quick feasible plan: nodes in program order, each taking the strategy that is cheapest
    given the choices already made upstream (own cost + resharding of its operands), restricted to
    keep tied outputs equal to their inputs. Used as the solver's starting hint and as the answer
    of last resort when the solver finds nothing in its time limit."""
    incoming: dict[int, list] = defaultdict(list)
    for e in problem.edges:
        incoming[e.dst].append(e)

    def cheapest(node, allowed, choice, done) -> int:
        best, best_cost = 0, None
        for i in allowed:
            c = node.costs[i]
            for e in incoming[node.index]:
                if e.src in done:
                    c += problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[i])
            if best_cost is None or c < best_cost:
                best, best_cost = i, c
        return best

    return _in_program_order(problem, cheapest)


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
            problem.edge_time(e.tensor, e.src_specs[current[e.src]], e.dst_specs[current[e.dst]]) for e in edges)

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
    not get worse. Makes the solver's hint and its answer of last resort better: on three
    remat-wrapped attention blocks on 2x4 it reaches the optimum from a greedy plan 2.6x above it
    (0.05 s)."""
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
    constraint from it. GPT-39B single stage on 8x8 V100 16 GB, the second round's CP-SAT model
    (one worker): 23 s to its optimum from the over-budget plan (the first plan under the budget
    after 9 s), 6 s to prove the same optimum from that optimum."""
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


def _ties_hold(problem: Problem, choice: Sequence[int]) -> bool:
    return all(problem.spec(a, choice) == problem.spec(b, choice) for a, b in problem.ties)


def _fits(problem: Problem, choice: Sequence[int], budget: float | None) -> bool:
    return budget is None or memory_profile(problem, choice).max() <= budget


def _cut_key(problem: Problem, choice: Sequence[int], point: int) -> tuple:
    """What a memory constraint added at `point` from `choice` (`_Model.memory_expr`) stands for:
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


PROBE_UNITS = 1.0  # deterministic units of `probe_bound`'s run


def probe_bound(problem: Problem, memory_budget: float, units: float = PROBE_UNITS, workers: int = 1) -> float:
    """Seconds per step no plan of `problem` under `memory_budget` goes below, from a short CP-SAT run
    (`units` deterministic units) on the model `solve` starts from: the objective with the strategies
    the memory lower bound rules out (`over_budget_strategies`). `solve`'s later rounds only add
    memory constraints, so the run's bound holds for every plan it can return. Where the budget binds
    this bound is far above `search.step_time_lower_bound` (the per-op cheapest strategies ignore
    that ruling out a layout makes its neighbours reshard): GPT-39B on 8x8 V100 16 GB, after 1 unit
    per mesh, 12.9 s/step for 8x8 (its plan 22.58 s), 70.8 to 153.9 s for the other 2-D meshes
    (0.30 s each without the budget's exclusions), so the mesh search solves 8x8 first and need
    not solve the others (`search.search_meshes`). 0 when the run finds no finite bound (an
    infeasible model is left to `solve` to report)."""
    model = _Model(problem)
    model.m.Minimize(model.objective)
    for r, i in over_budget_strategies(problem, memory_budget):
        model.m.Add(model.x[r][i] == 0)
    _, status = model.solve(units, WALL_CAP_FACTOR * units + WALL_CAP_FLOOR_S, workers, None)
    bound = model.last.bound / _NS / (1 + _BEAT_MARGIN)
    return bound if status != cp_model.INFEASIBLE and math.isfinite(bound) and bound > 0 else 0.0


def solve(problem: Problem, memory_budget: float | None = None, time_limit: float = 30.0,
          workers: int = 1, max_rounds: int = 30, min_peak_search: bool = True,
          begin: Sequence[int] | None = None, lp_level: int = 1,
          beat: Callable[[], float] | None = None) -> Solution:
    """Solves the ILP; with a budget, adds memory constraints until the plan's peak fits.

    `time_limit` is in CP-SAT deterministic units for all rounds together (about one second of one
    idle core each, see the module's docstring); a wall-clock cap of `WALL_CAP_FACTOR` times as many
    seconds plus `WALL_CAP_FLOOR_S` stops the search on an overloaded machine.

    `begin`: a choice to start from (the hint and the fallback) when it beats the greedy one: it
    fits the budget and the greedy does not, or both do (or neither) and it is faster.

    `beat`: the step time (seconds) of a plan found elsewhere, read as the search goes (the mesh
    search's best so far, which other threads lower): once CP-SAT's objective bound in any round
    exceeds it, no plan of this problem can beat that plan (each round's bound holds for the final
    problem: rounds only add constraints), so the search stops with `OutboundError`.

    `lp_level`: CP-SAT's `linearization_level`: 1 (its default) adds the linear constraints to its
    LP relaxation lazily; 2 adds them all with cuts. 2 pays on small ILPs whose overlap term (the
    max-plus chain of `_Model._overlap`) the LP must see to bound the objective: the per-layer ILPs
    of the pipeline stage tables (`stages.stage_cost`), 42-46 decisions each; measured on 21 such
    ILPs saved from GPT-39B (8x8 V100), llama-7b (2x8 A100) and gpt3-1.3b (8x8 V100) pipeline
    searches, one worker, deterministic units, the same optimum on each: 63.3 -> 39.4 in all, the
    slowest 21.9 -> 8.5 and 9.6 -> 4.2. It does not pay on whole-model ILPs (gpt2-small 2x4 1.30 ->
    1.54, llama-7b 8x8 4.51 -> 7.71, 13 single-stage ILPs of the gpt3-1.3b / llama-7b searches
    37.5 -> 51.8 in all), which keep 1. WORKSPACE.md, Measured.

    Raises:
      InfeasiblePlanError: when no plan fits `memory_budget`; the message, `min_memory_bytes` and
        `lower_bound_bytes` give the smallest per-device peak found and a proven lower bound
        (`min_peak_search=False`: found without the CP-SAT minimum-peak search, `_infeasible`).
    """
    start = time.perf_counter()
    wall_cap = WALL_CAP_FACTOR * time_limit + WALL_CAP_FLOOR_S
    if memory_budget is not None:
        bound = memory_lower_bound(problem)
        if bound.max() > memory_budget:  # provably infeasible: no CP-SAT search for a plan
            raise _infeasible(problem, memory_budget, time_limit, workers, bound, min_peak_search)
    model = _Model(problem)
    model.m.Minimize(model.objective)
    if memory_budget is not None:
        excluded = over_budget_strategies(problem, memory_budget)
        for r, i in excluded:
            model.m.Add(model.x[r][i] == 0)
        if excluded:
            log.info("memory budget: %d of %d strategies ruled out by the lower bound", len(excluded),
                     sum(len(v) for r, v in enumerate(model.x) if problem.rep[r] == r))
    points: set[tuple] = set()  # the memory constraints added (`_cut_key`)
    fallback = greedy(problem)
    if _ties_hold(problem, fallback):
        fallback = improve(problem, fallback)
    if begin is not None and _ties_hold(problem, begin):
        def rank(choice):  # plans that fit the budget first, then the faster
            return not _fits(problem, choice, memory_budget), plan_cost(problem, choice)
        if not _ties_hold(problem, fallback) or rank(begin) < rank(fallback):
            fallback = tuple(begin)  # a caller's plan (e.g. a coarser mesh's, `search.refined_choice`) is better
    hint = fallback if _ties_hold(problem, fallback) else None
    start_fits = hint is not None and _fits(problem, fallback, memory_budget)  # the answer when the limit comes first
    status_name = "optimal"
    det_used = 0.0
    limit = None
    run = None
    unbudgeted = None
    for rounds in range(1, max_rounds + 1):
        det_left = time_limit - det_used
        wall_left = wall_cap - (time.perf_counter() - start)
        choice, status = model.solve(det_left, wall_left, workers, hint, lp_level,
                                     None if beat is None else lambda: beat() * _NS * (1 + _BEAT_MARGIN))
        run = model.last
        det_used += run.deterministic_time
        if model.cut is not None:
            log.info("solver bound %.4g s/step is over the %.4g s/step of a plan found elsewhere: stopped",
                     model.cut[0] / _NS, beat())
            raise OutboundError(model.cut[0] / _NS, model.cut[1] / _NS / (1 + _BEAT_MARGIN), det_used)
        if not run.optimal and status != cp_model.INFEASIBLE:
            limit = "deterministic" if det_used >= time_limit * 0.999 else "wall-clock"
        if choice is None:
            if status == cp_model.INFEASIBLE and memory_budget is not None:
                raise _spent(_infeasible(problem, memory_budget, time_limit, workers, search=min_peak_search),
                             det_used)
            if status == cp_model.UNKNOWN and start_fits:
                log.warning("solver found no plan within its limit (%.3g deterministic units): using the greedy "
                            "plan (raise solver_time_limit for a better one)", time_limit)
                choice, status_name = fallback, "heuristic"
                profile = memory_profile(problem, choice)
                break
            if status == cp_model.UNKNOWN and memory_budget is not None:  # not decided: no raw status
                peak = profile.max() if rounds > 1 else memory_profile(problem, fallback).max()
                raise _spent(_undecided(problem, memory_budget, time_limit, peak), det_used)
            error = InfeasiblePlanError if status == cp_model.INFEASIBLE else PlannerError
            raise _spent(error(f"{_status_words(status)} (solver limit {time_limit:.3g} deterministic units); "
                               "raise solver_time_limit"), det_used)
        if status != cp_model.OPTIMAL:
            status_name = "feasible"
        profile = memory_profile(problem, choice)
        if memory_budget is None:
            break
        new = _violations(profile, memory_budget, _settled(problem, choice, points))
        if not new:
            if profile.max() > memory_budget:
                raise _spent(_infeasible(problem, memory_budget, time_limit, workers, search=min_peak_search),
                             det_used)
            if start_fits and status != cp_model.OPTIMAL and plan_cost(problem, fallback) < plan_cost(problem, choice):
                # the limit came first and the start is faster (GPT-39B 16x4 on 8x8 V100 16 GB: 166 s/step
                # after 6 units; 24 more from that plan returned 223 s/step)
                choice, profile = fallback, memory_profile(problem, fallback)
            break
        if rounds == 1:
            unbudgeted = (plan_cost(problem, choice), int(profile.max()), len(excluded))
        for p in new:
            model.m.Add(model.memory_expr(p, choice) <= int(memory_budget // _MEM_UNIT))
            points.add(_cut_key(problem, choice, p))
        # The next round starts from this round's plan (over the budget), repaired to fit it when
        # `repair` can: a fitting plan next to it. Starting from the start plan when that fits (a
        # fitting plan far from it) was tried on GPT-39B's 2-D meshes on 8x8 V100 16 GB, 30 units
        # each: better on two (16x4 137 -> 115 s/step), worse on two (8x8 stayed near its start: 442
        # s/step, 62 from this round's plan), one the same.
        hint = choice
        fixed = repair(problem, choice, memory_budget, excluded)
        if fixed is not None:  # a plan under the budget next to this one: the next round starts there
            hint = fixed
            if not start_fits or plan_cost(problem, fixed) < plan_cost(problem, fallback):
                fallback, start_fits = fixed, True
        log.info("memory round %d: peak %.3g B over budget %.3g B, %d constraints%s", rounds, profile.max(),
                 memory_budget, len(points), "" if fixed is None else
                 f"; next round from a plan under it ({plan_cost(problem, fixed):.4g} s/step)")
        if det_used >= time_limit * 0.999 or time.perf_counter() - start >= wall_cap:
            if start_fits:  # the limit came before a solver plan under the budget, but the start fits: use it
                log.warning("solver found no plan under the budget within its limit (%.3g deterministic units): "
                            "using the best plan under the budget it had (raise solver_time_limit for a better one)",
                            time_limit)
                choice, status_name = fallback, "heuristic"
                profile = memory_profile(problem, choice)
                break
            raise _spent(_undecided(problem, memory_budget, time_limit, profile.max()), det_used)
    elapsed = time.perf_counter() - start
    gap = run.gap() if run is not None else None
    if status_name != "optimal" and run is not None and np.isfinite(run.bound):  # of the plan returned
        obj = plan_cost(problem, choice) * _NS
        gap = max(0.0, (obj - run.bound) / max(obj, 1.0))
    if status_name == "optimal":
        limit = None
    elif limit is not None:
        log.warning("solver %s limit reached: returning the best plan found, not proven optimal (gap %s to the "
                    "best bound)", limit, "unknown" if gap is None else f"{gap:.2%}")
    return Solution(tuple(choice), plan_cost(problem, choice), status_name, elapsed, int(profile.max()), rounds,
                    status_name == "optimal", gap, det_used, limit, unbudgeted)


def _undecided(problem: Problem, budget: float, time_limit: float, peak: float) -> InfeasiblePlanError:
    """The error when the solver's limit stopped the search before a plan under `budget` was found
    or ruled out (`proven` False: a plan may still fit; `search.no_fit_error` says so): the peak of
    the best plan it had, and the proven lower bound."""
    lower = int(memory_lower_bound(problem).max())
    error = InfeasiblePlanError(
        f"no plan fitting {_gb(budget)} per device on mesh {problem.cost.mesh} was found within the solver limit "
        f"({time_limit:.3g} deterministic units); the best plan so far needs {_gb(peak)} (no plan goes below "
        f"{_gb(lower)}); raise solver_time_limit", int(peak), lower, proven=False)
    return error


def memory_floor(graph: Graph, num_devices: int, donated: frozenset[int] = frozenset()) -> int:
    """Bytes per device every plan on `num_devices` devices keeps live at the end of the step,
    known before any ILP is built: each argument, and each output computed from the arguments, at
    `nbytes // num_devices`. `memory_profile` counts them there, each in its planned layout: an
    argument is decided and lives for the whole program, such an output is decided, written and
    lives to the end (`problem.live_ranges`), and no layout splits a tensor more than `num_devices`
    ways. Below `memory_lower_bound` of every mesh of that size (it needs the built ILP); without
    host offload, which moves arguments off the device (the mesh search uses it only then). Donated
    arguments (`donated`, input tensor ids) are left out: their buffers may hold outputs by then."""
    derived = set(graph.inputs)
    for op in graph.ops:
        if any(isinstance(x, int) and x in derived for x in op.inputs):
            derived.update(op.outputs)
    ends = (set(graph.inputs) - donated) | {t for t in graph.outputs if isinstance(t, int) and t in derived}
    return sum(graph.tensors[t].nbytes // num_devices for t in ends)


def liveness_floor(problem: Problem) -> int:
    """Bytes per device every plan keeps live at the fullest program point, on any mesh of
    `problem`'s device count: `memory_profile`'s tensor terms (each value the plan materialises,
    over its live range) with every value split over every device (`nbytes // devices`, which no
    layout goes below), its operand copies and reduction buffers left out (they only add).

    The values and live ranges that term counts come from the graph, the platform's fusions and
    the donated arguments, not from the mesh's shape (`build_problem`), so after one mesh's ILP is
    built this bounds every mesh of that size before theirs are (`search.search_meshes`); it is
    below each one's `memory_lower_bound` (tests/test_search_pruning.py). Not with host offload,
    whose live ranges depend on the plan."""
    n = len(problem.graph.ops)
    devices = problem.cost.mesh.size
    delta = np.zeros(n + 3, dtype=np.int64)
    for tid, (first, last) in enumerate(problem.live):
        if _materialised(problem, tid, first):
            b = problem.graph.tensors[tid].nbytes // devices
            delta[first + 1] += b
            delta[last + 2] -= b
    return int(np.cumsum(delta).max())


def _spent(error: PlannerError, deterministic_time: float) -> PlannerError:
    """`error` with the CP-SAT deterministic time spent before it (the mesh search reports it)."""
    if isinstance(error, InfeasiblePlanError):
        error.deterministic_time = deterministic_time
    return error


def memory_lower_bound(problem: Problem) -> np.ndarray:
    """Per program point, bytes per device that every plan the planner can choose keeps live there.

    The terms of `memory_profile` grouped by the decision that sets them (as the ILP's
    `_Model.memory_expr` groups them into one coefficient per decision and strategy), each group at
    its least over that decision's strategies, point by point: the tensors a decision owns (every
    layer sharing it counted), the operand copies its consumers read in its layout, its XLA:CPU
    reduction buffers. A copy that exists only when resharded counts at its consumer's smallest
    layout, or not at all where some layout pair needs none. A decision takes one strategy in every
    plan, so each group of `memory_profile(problem, choice)` is at least its least here, point by
    point, for every `choice`: `max()` is a sound lower bound on the planner's peak under sharding
    alone, for any choice, ties held or not (tests/test_infeasible.py checks it against plans and
    random choices). Grouping by decision counts that one strategy cannot make every value small at
    once (on XLA:CPU, a strategy that splits a tensor may reduce partial sums the others do not):
    mlp-tiny on 1x8 CPU 16.0 -> 22.2 KB, llama-tiny 897 -> 909 KB, against each term at its own
    smallest; equal on the GPU presets measured (gpt3-39b on 8x8 V100: 15.39 GB on every mesh shape).
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

    for tid, (first, last) in enumerate(problem.live):
        if not _materialised(problem, tid, first):
            continue
        r = rep[problem.owner[tid]]
        b = owned(tid)
        spans[r].append((b, first + 1, last + 2))
        if cpu and last == n:
            reserved_of[r] = reserved_of.get(r, 0) + b
    for tid, op in problem.host_reads:  # a host-kept argument copied in for one op (`Problem.host_reads`)
        spans[rep[problem.owner[tid]]].append((owned(tid), op + 1, op + 2))
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


def _min_bytes_choice(problem: Problem) -> tuple[int, ...]:
    """Per distinct decision, the strategy whose owned tensors take the fewest bytes (ties broken
    by the lower cost); tied outputs follow their inputs where they can."""
    mesh = problem.cost.mesh

    def fewest_bytes(node, allowed, choice, done) -> int:
        size = [sum(shard_bytes(problem.graph.tensors[t], specs[i], mesh) for t, specs in node.owned.items())
                for i in range(node.size)]
        return min(allowed or range(node.size), key=lambda i: (size[i], node.costs[i]))

    return _in_program_order(problem, fewest_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Lever:
    """A way to need less memory per device, as the message of a budget no plan fits names it.

    Attributes:
      name: what it is ("host offload").
      state: "tried" (the plans searched use it), "option" (the user can turn it on, `how`) or
        "missing" (not available in single-stage plans yet).
      how: for an option, how to turn it on (API and CLI).
    """

    name: str
    state: str
    how: str = ""


# The levers an infeasible single-stage budget reports, in the order the message lists them. A new
# lever is one more entry here (or an entry's state changed to "tried").
LEVERS: tuple[Lever, ...] = (
    Lever("sharding every tensor", "tried"),
    Lever("gradient accumulation", "option", "accumulate='auto' (--accumulate auto)"),
    Lever("pipeline stages with recomputation", "option", "pipeline='auto' (--pipeline auto)"),
    Lever("rematerialisation", "option", "remat='auto' (--remat auto)"),
    Lever("host offload", "option", "offload='auto' (--offload auto)"),
    Lever("donating the train state", "option", "plan_parallel(donate_argnums=0) (--donate 0)"),
)


def levers_of(problem: Problem, levers: Sequence[Lever] = LEVERS) -> tuple[Lever, ...]:
    """`levers` with those `problem` uses marked tried: host offload, donated arguments."""
    used = {"host offload": bool(problem.offloaded), "donating the train state": bool(problem.donated)}
    return tuple(dataclasses.replace(v, state="tried") if used.get(v.name) else v for v in levers)


def levers_text(levers: Sequence[Lever] = LEVERS) -> str:
    """The levers as one sentence group: tried, other options (how), not available yet."""
    tried = [v.name for v in levers if v.state == "tried"]
    options = [f"{v.name}: {v.how}" if v.how else v.name for v in levers if v.state == "option"]
    missing = [v.name for v in levers if v.state == "missing"]
    parts = [f"Tried: {', '.join(tried) or 'nothing'}"]
    if options:
        parts.append(f"Other levers: {'; '.join(options)}")
    if missing:
        parts.append(f"Not available in single-stage plans yet: {', '.join(missing)}")
    return ". ".join(parts)


def smallest_peak(problem: Problem, det_limit: float, workers: int = 1,
                  lower_bound: int | None = None) -> int | None:
    """The smallest per-device peak found for `problem`: the fewest-bytes plan's, then (when that
    is above the lower bound and `det_limit` > 0) a minimum-peak CP-SAT search of at most
    `det_limit` deterministic units started from it. None when neither found a plan. `lower_bound`:
    `memory_lower_bound(problem).max()` when the caller has it."""
    lower = int(memory_lower_bound(problem).max()) if lower_bound is None else lower_bound
    best = None
    seed = _min_bytes_choice(problem)
    if _ties_hold(problem, seed):
        best = int(memory_profile(problem, seed).max())
    if det_limit > 0 and (best is None or best > lower):
        found = _min_peak_search(problem, det_limit, workers, seed if best is not None else None)
        if found is not None:
            best = found if best is None else min(best, found)
    return best


def _infeasible(problem: Problem, budget: float, time_limit: float, workers: int,
                bound: np.ndarray | None = None, search: bool = True) -> InfeasiblePlanError:
    """The error for a budget no plan fits: the proven lower bound, the smallest peak found
    (`smallest_peak`: the fewest-bytes plan, then with `search` a minimum-peak CP-SAT search of at
    most `MIN_MEMORY_LIMIT` deterministic units), and the levers tried and not available (`LEVERS`)."""
    if bound is None:
        bound = memory_lower_bound(problem)
    lower = int(bound.max())
    mesh = problem.cost.mesh
    on_host = {t for t, _ in problem.offloaded}  # host-offloaded state is not held on the device
    args = sum(min(shard_bytes(problem.graph.tensors[t], s, mesh) for s in set(problem.nodes[problem.owner[t]].owned[t]))
               for t in problem.graph.inputs if t in problem.owner and t not in on_host)
    best = smallest_peak(problem, min(time_limit, MIN_MEMORY_LIMIT) if search else 0.0, workers, lower)
    where = int(np.argmax(bound))
    at = (f"op {where - 1} ({problem.graph.ops[where - 1].primitive})" if 0 < where <= len(problem.graph.ops)
          else "the end of the step")
    found_text = (f"the smallest per-device peak the planner could reach is {_gb(best)}"
                  + (" (the minimum)" if best == lower else "")
                  if best is not None else "no plan was found to measure the smallest reachable peak")
    levers = levers_of(problem)
    error = InfeasiblePlanError(
        f"no plan fits the memory budget of {_gb(budget)} per device on mesh {mesh}: {found_text}; no plan can "
        f"go below {_gb(lower)} (lower bound: {_gb(args)} of {'device-resident ' if on_host else ''}arguments split "
        "over every mesh axis that divides "
        f"them, plus what must be live together at {at}). {levers_text(levers)}. Raise memory_budget or use more "
        "devices", best, lower, levers=levers,  # the mesh search's one-line answer lists them (`search.no_fit_error`)
    )
    return error


def _gb(nbytes: float) -> str:
    return format_bytes(nbytes)


def _min_peak_search(problem: Problem, det_limit: float, workers: int, hint: Sequence[int] | None) -> int | None:
    """The smallest liveness peak CP-SAT finds within `det_limit` deterministic units: minimise a
    peak variable bounding the memory at each program point added so far; add the new plan's
    highest point; stop when the solve is optimal and its highest point is already bounded (the
    model's minimum) or the limit is spent. Returns the smallest peak measured, or None."""
    model = _Model(problem)
    total = sum(t.nbytes for t in problem.graph.tensors) // _MEM_UNIT + 1
    peak = model.m.NewIntVar(0, total, "peak")
    model.m.Minimize(peak)
    points: set[tuple] = set()  # the constraints added (`_cut_key`)
    if hint is not None:  # start from the hint's highest points, not an unconstrained model
        for p in _violations(memory_profile(problem, hint), -1, set()):
            model.m.Add(model.memory_expr(p, hint) <= peak)
            points.add(_cut_key(problem, hint, p))
    best = None
    det_used = 0.0
    choice = hint
    for _ in range(20):
        if det_used >= det_limit * 0.999:
            break
        left = det_limit - det_used
        choice, status = model.solve(left, WALL_CAP_FACTOR * left + WALL_CAP_FLOOR_S, workers, choice)
        det_used += model.last.deterministic_time
        if choice is None:
            log.info("minimum-memory search stopped: %s", _status_words(status))
            break
        profile = memory_profile(problem, choice)
        best = int(profile.max()) if best is None else min(best, int(profile.max()))
        top = int(np.argmax(profile))
        if _cut_key(problem, choice, top) in points:
            break  # optimal: the model's minimum; otherwise the limit left no better plan
        model.m.Add(model.memory_expr(top, choice) <= peak)
        points.add(_cut_key(problem, choice, top))
    return best
