"""The memory model: per-device bytes live at each program point under a choice (`memory_profile`),
the one count that the ILP's memory constraints and the memory lower bound also follow."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.ilp.live_ranges import kept_in_fusion
from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes


def memory_profile(problem: Problem, choice: Sequence[int]) -> np.ndarray:
    """Per-device bytes live at each program point under `choice`.

    Point k+1 is "while op k runs". Counted, in this one model that `memory_lower_bound` and the
    ILP's `memory_constraints.memory_expr` also follow:
      - every tensor a node decides, in its planned layout, from its producer to its last use
        (arguments and outputs: `Problem.live`), except values of the optimizer update that XLA
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
    decided = problem.decided_live()
    for tid, (first, last) in decided:
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
    for tid, op, share in problem.host_reads:  # a host-kept argument (or a slice) copied in for one op
        profile[op + 1] += int(shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh) * share)
    for e in problem.edges:
        at = _transient_point(problem, e)
        if _copied_only_if_resharded(problem, e) and e.src_specs[choice[e.src]] == e.dst_specs[choice[e.dst]]:
            continue  # a pinned output or an update operand already in its layout: no copy
        b = shard_bytes(problem.graph.tensors[e.tensor], e.dst_specs[choice[e.dst]], mesh)
        profile[at] += b
    reserved = sum(shard_bytes(problem.graph.tensors[tid], problem.spec(tid, choice), mesh)
                   for tid, (first, last) in decided if last == n and _materialised(problem, tid, first))
    reserved += sum(_unfit_buffers(problem, node, choice[node.index]) for node in problem.nodes)
    return np.append(profile, reserved if _xla_cpu(problem) else 0)


def _materialised(problem: Problem, tid: int, first: int) -> bool:
    """Whether tensor `tid` (made by op `first`) takes memory of its own: a decided tensor, unless
    XLA keeps it inside a fusion (`live_ranges.kept_in_fusion`): on XLA:GPU any such value, on XLA:CPU
    only the optimizer update's (the combinable tail). optax computes
    each step of the update for every leaf before the next step (all m-hat, then all v-hat, ...),
    so in program order such values of every leaf are live at once, while XLA fuses each leaf's
    elementwise update into one loop and never writes them (counting them over-predicted the
    compiled peak), and a residual XLA:CPU recomputes in the backward's fusion
    (`Problem.recomputed`, `fusion.recomputed`). Elsewhere on XLA:CPU values kept inside fusions
    still count: dropping them everywhere under-predicted wresnet-tiny's peak."""
    return tid in problem.owner and not kept_in_fusion(tid, first, problem.unwritten, problem.combinable,
                                                         problem.memory_platform, problem.recomputed)


def _copied_only_if_resharded(problem: Problem, e) -> bool:
    """Edges whose operand copy exists only when the layouts differ: a pinned output resharded at
    the end, and the operands of the optimizer update (the combinable tail): XLA reads an update
    operand already in its layout in place (counting every update operand as a copy over-predicted
    XLA's compiled peak). On XLA:GPU every edge: an operand read in its layout is read in place
    (counting a copy at every consumer counted the unsharded gpt2-small's logits gradient twice;
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
    (gpt-tiny on 1x8 under a budget: XLA reported more outputs and temporaries than were live at
    the combined all-reduce). The extra point of `memory_profile` counts arguments, all outputs
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
    `memory_constraints.memory_expr` the temporary is: ("t", tensor id), ("e", edge index) or ("r", node,
    strategy, bytes) for a reduction buffer. Arguments are not temporaries; a donated argument's
    output is not a free buffer (its argument holds it until its last read, `live_ranges`)."""
    mesh = problem.cost.mesh
    n = len(problem.graph.ops)
    donated_outputs = {tout for _, tout in problem.donated}
    outputs = {x for x in problem.graph.outputs if isinstance(x, int)}
    temps: list[tuple[int, int, int, tuple]] = []
    slots: list[tuple[int, int]] = []
    for tid, (first, last) in problem.decided_live():
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
    assignment with `--xla_dump_to`: one output's allocation held many smaller temporaries, each
    alone at offset 0). The liveness count (`_liveness_profile`) counts an output from its
    write, so it lets every live temporary use every unwritten output's bytes; this is the rest:
    at each point the live temporaries, largest first, each take a free unwritten output they fit
    in (the most bytes any one-per-buffer placement holds), and the unwritten outputs' bytes left
    over count as well (experiments/check_memory.py).

    Worked out only where it can matter: a point whose liveness count plus all its unwritten
    outputs' bytes cannot exceed the highest point worked out (or the liveness peak) keeps its
    liveness count, below the profile's peak. Other platforms: zeros (a GPU's buffer assignment has not been read here)."""
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
