"""The step time of a choice of strategies: the one number the ILP minimises and the plan reports.

    step = sum over nodes of their strategy's cost (compute + own collectives)
         + the latency of each group of combined collectives, once
         + the resharding time of every edge (`strategies.edge_time`)
         - the combinable collectives' time hidden behind later compute (`Problem.overlap`)

Overlap (XLA's latency-hiding scheduler, `Plan.xla_flags`), two streams:

1. Gradient reductions (collectives
of ops whose results feed no matmul) run on a communication stream of their own, first in first
out, each issued when the node that makes it has computed (program order of the nodes' root ops);
compute runs on without waiting for them. The stream finishes
    F = max over such nodes k of (compute up to k + async time of k and every later node),
so the exposed part is max(0, max_k(async from k on - compute after k)) and the rest is hidden.
The ILP holds the same max through Lindley's recursion in max-plus form (`overlap.add_overlap`):
a run of identical layers is modelled once and composed in closed form, so the model does not grow
with depth.

2. Prefetch: resharding a program argument for the op that reads it (ZeRO-3 / FSDP parameter
all-gathers, splitting the batch) depends on nothing computed, so the scheduler issues it ahead of
its consumer: in consumer order from the start of the step, first in first out, each needed before
its consumer computes. Compute stalls max(0, max_k(prefetch up to k - compute before k)); the rest
is hidden (`prefetch_hidden`). The same recursion run over the nodes in reverse order gives that
stall, so the ILP models it with the same machinery (`overlap.add_prefetch`).

Approximations, stated: only compute hides communication (blocking collectives and resharding
between ops keep the compute stream busy but share the links, so they hide nothing); the two streams
do not slow each other down; each combined group's one latency stays exposed; prefetched buffers
are not counted earlier in the memory model (they are counted at their consumer), and XLA bounds
how far ahead it prefetches by memory, which this model does not.

Collectives of ops whose results feed no matmul (the gradient reductions and the optimizer update
of a train step) are priced bandwidth-only in the node costs: XLA's combiner passes merge the
independent ones of one kind over one group of devices into a single collective, whose latency is
paid once (`CostModel.collective_latency`). The CP-SAT model holds one boolean per such
(kind, axes) group, set when any chosen strategy joins it, so the solver's objective and
`step_time` agree term for term (tests/test_objective.py checks it against the solver's own value).

3. Host offload (`planner.ilp.offload`, `Problem.offloaded`): optimizer state kept in the host's memory
is copied in at the host link's bandwidth (`Hardware.host_bandwidth`, one direction per device) and
its new value copied back. The copies in depend on nothing computed: issued at the start of the
step, they hide behind the compute before the first op that reads offloaded state (with overlap);
the copies back follow the update and stay exposed (`offload_transfer`, `offload_hidden`).

Input nodes carry a tie-break (`problem.TIE_BREAK_S_PER_BYTE` per argument byte kept on a device)
in their cost; it is part of the objective and is reported as compute (0.1 us per MiB).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.ilp.problem import Problem
from planner.ilp.strategies import shard_bytes
from planner.core.plan_records import CombinedLatency, StepPart, StepTimeParts
from planner.core.sharding import format_spec


@dataclasses.dataclass(frozen=True, slots=True)
class StepTime:
    """The parts of a choice's step time (seconds, per device).

    Attributes:
      compute_s: local compute of every op (and the input nodes' tie-break).
      collectives_s: the ops' own collectives (partial sums, pre-gathers of followers), combined
        groups at bandwidth only.
      combined_latency_s: one latency per group of combined collectives.
      resharding_s: collectives on edges (an operand read in another layout than produced).
      hidden_s: the part of the combinable collectives that runs beside later compute (and of
        the host-offload copies in, behind earlier compute).
      host_transfer_s: copies of host-offloaded state to the device and back (`offload_transfer`).
    """

    compute_s: float
    collectives_s: float
    combined_latency_s: float
    resharding_s: float
    hidden_s: float = 0.0
    host_transfer_s: float = 0.0

    @property
    def communication_s(self) -> float:
        """All communication, hidden or not."""
        return self.collectives_s + self.combined_latency_s + self.resharding_s + self.host_transfer_s

    @property
    def exposed_s(self) -> float:
        """Communication on the step's critical path."""
        return self.communication_s - self.hidden_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_s


def overlap_order(problem: Problem) -> list:
    """The nodes that compute or communicate, in program order of their root op (inputs excluded)."""
    return sorted((n for n in problem.nodes if n.ops), key=lambda n: n.ops[0])


def prefetched(problem: Problem, e, arguments: frozenset[int] | None = None) -> bool:
    """Whether edge `e` reshards a program argument for the op that reads it (a parameter all-gather
    of a ZeRO-3 plan, a batch split): its source is ready when the step starts, so XLA's scheduler
    can issue it ahead of the op (`prefetch_hidden`). `arguments`: `frozenset(graph.inputs)`, when
    the caller asks for many edges."""
    args = frozenset(problem.graph.inputs) if arguments is None else arguments
    return e.op >= 0 and e.tensor in args and bool(problem.nodes[e.dst].ops)


def prefetch_hidden(problem: Problem, choice: Sequence[int]) -> float:
    """Seconds of argument resharding (`prefetched` edges) hidden behind earlier compute.

    Issued from the start of the step in order of their consumers on one link, first in first out,
    each needed before its consumer computes: compute stalls for
        max(0, max over consumers k of (prefetch issued up to k - compute before k))
    and the rest is hidden. Only when the problem asks for it (`Problem.prefetch`, with overlap)."""
    if not (problem.overlap and problem.prefetch):
        return 0.0
    amounts: dict[int, float] = {}
    edges = problem.edges
    args = frozenset(problem.graph.inputs) if edges else frozenset()
    for e in edges:
        if prefetched(problem, e, args):
            s = problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]], e.op)
            if s:
                amounts[e.dst] = amounts.get(e.dst, 0.0) + s
    if not amounts:
        return 0.0
    issued = done = stall = 0.0
    for node in overlap_order(problem):
        a = amounts.get(node.index, 0.0)
        if a:
            issued += a
            stall = max(stall, issued - done)
        i = choice[node.index]
        done += node.costs[i] - node.comm_s[i]
    return issued - stall


def hidden_time(problem: Problem, choice: Sequence[int]) -> float:
    """Seconds of communication hidden behind compute (see the module docstring): the combinable
    collectives behind later compute, the arguments' resharding behind earlier compute
    (`prefetch_hidden`) and the host-offload copies in (`offload_hidden`)."""
    return _async_hidden(problem, choice) + prefetch_hidden(problem, choice) + offload_hidden(problem, choice)


def offload_start(problem: Problem) -> int:
    """The first op that reads host-offloaded state (where its device range starts,
    `live_ranges.offloaded_live_ranges`): the copies in must be done by then."""
    return min((problem.live[t][0] for t, _ in problem.offloaded), default=len(problem.graph.ops))


def offload_transfer(problem: Problem, choice: Sequence[int]) -> tuple[float, float]:
    """(seconds in, seconds back) per device of the host-offloaded state under `choice`: each
    argument's shard, once for the update and once more for each read before it
    (`Problem.host_reads`: a master parameter's casts), and its new value's (tied to it: the same
    layout), over the host link."""
    if not problem.offloaded:
        return 0.0, 0.0
    bandwidth = problem.cost.hardware.host_bandwidth
    reads = [(t, 1.0) for t, _ in problem.offloaded] + [(t, share) for t, _, share in problem.host_reads]
    tin = sum(shard_bytes(problem.graph.tensors[t], problem.spec(t, choice), problem.cost.mesh) * share
              for t, share in reads)
    tout = sum(shard_bytes(problem.graph.tensors[t], problem.spec(t, choice), problem.cost.mesh)
               for t, o in problem.offloaded if o >= 0)
    return tin / bandwidth, tout / bandwidth


def offload_hidden(problem: Problem, choice: Sequence[int]) -> float:
    """Seconds of the host-offload copies in hidden behind the compute before `offload_start`
    (with overlap and an update that is not streamed, and no argument read before the update
    (`Problem.host_reads`, whose copies count as exposed); the copies back are exposed)."""
    if not (problem.overlap and problem.offloaded) or problem.graph.update_groups or problem.host_reads:
        return 0.0  # streamed (`ilp.offload.streamed`): each group's copies wait for the group before
    start = offload_start(problem)
    before = 0.0
    for node in overlap_order(problem):
        if node.ops[0] >= start:
            break
        i = choice[node.index]
        before += node.costs[i] - node.comm_s[i]
    return min(offload_transfer(problem, choice)[0], before)


def _async_hidden(problem: Problem, choice: Sequence[int]) -> float:
    """Seconds of combinable collectives hidden behind later compute."""
    if not problem.overlap:
        return 0.0
    exposed = async_total = compute_after = 0.0
    for node in reversed(overlap_order(problem)):
        i = choice[node.index]
        if node.async_s[i] > 0:
            async_total += node.async_s[i]
            exposed = max(exposed, async_total - compute_after)
        compute_after += node.costs[i] - node.comm_s[i]
    return async_total - exposed


def combined_groups(problem: Problem, choice: Sequence[int]) -> frozenset[tuple[str, tuple[int, ...]]]:
    """The (kind, axes) groups of combined collectives the choice pays a latency for."""
    out: set = set()
    for node in problem.nodes:
        out |= node.combined[choice[node.index]]
    return frozenset(out)


def step_time(problem: Problem, choice: Sequence[int]) -> StepTime:
    """The step time of `choice`, split into its parts; `.total_s` is the ILP's objective."""
    compute = collectives = 0.0
    for node in problem.nodes:
        i = choice[node.index]
        collectives += node.comm_s[i]
        compute += node.costs[i] - node.comm_s[i]
    latency = sum(problem.cost.collective_latency(kind, axes) for kind, axes in combined_groups(problem, choice))
    reshard = 0.0
    for e in problem.edges:
        reshard += problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]], e.op)
    return StepTime(compute, collectives, latency, reshard, hidden_time(problem, choice),
                    sum(offload_transfer(problem, choice)))


def step_parts(problem: Problem, choice: Sequence[int]) -> StepTimeParts:
    """`step_time` of `choice` split by where it is paid, for explaining differences between plans.

    Returns a `StepTimeParts`:
      items: (label, layout, compute_s, collectives_s, resharding_s) per node label (an argument's
        "input PATH" or an op's name and module path; nodes sharing a label are summed, their
        layouts joined). An edge's resharding is paid at the argument it leaves when its producer
        is an argument (the argument's layout makes it), otherwise at the op that reads it.
      combined_latency: (kind, mesh axis names, seconds) per group of combined collectives.
      hidden_s: the communication hidden behind compute (subtracted once).
    With host offload, one more item "host offload" carries the copies in and back as collectives.
    The items' parts plus the latencies minus `hidden_s` sum to `step_time(...).total_s`.
    """
    mesh = problem.cost.mesh
    parts: dict[str, list] = {}

    def item(node) -> list:
        if node.label not in parts:
            parts[node.label] = [node.label, [], 0.0, 0.0, 0.0]
        rec = parts[node.label]
        i = choice[node.index]
        layout = node.descriptions[i] or "; ".join(dict.fromkeys(format_spec(v[i], mesh) for v in node.owned.values()))
        if layout and layout not in rec[1]:
            rec[1].append(layout)
        return rec

    for node in problem.nodes:
        i = choice[node.index]
        rec = item(node)
        rec[2] += node.costs[i] - node.comm_s[i]
        rec[3] += node.comm_s[i]
    for e in problem.edges:
        seconds = problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]], e.op)
        if seconds:
            src = problem.nodes[e.src]
            item(src if not src.ops else problem.nodes[e.dst])[4] += seconds
    if problem.offloaded:
        parts["host offload"] = ["host offload", ["pinned_host"], 0.0, sum(offload_transfer(problem, choice)), 0.0]
    latency = tuple(CombinedLatency(kind, tuple(mesh.axis_names[a] for a in axes),
                                    problem.cost.collective_latency(kind, axes))
                    for kind, axes in sorted(combined_groups(problem, choice)))
    return StepTimeParts(tuple(StepPart(r[0], "; ".join(r[1]), r[2], r[3], r[4]) for r in parts.values()),
                         latency, hidden_time(problem, choice))
