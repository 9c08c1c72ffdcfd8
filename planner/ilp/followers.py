"""Follower merging: an op with one array operand adds no decision of its own; its result's sharding
follows the operand's and its cost joins the strategies of the node that owns the operand (Alpa)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.core.sharding import Spec
from planner.cost_model import CostModel
from planner.graph.ir import Graph
from planner.ilp.rules import ELEMENTWISE
from planner.ilp.strategies import Comm, follow

HEAVY = frozenset({"dot_general", "conv_general_dilated"})


# Multi-operand ops that follow their first operand; the others are resharded to match.
FOLLOW_FIRST = frozenset(ELEMENTWISE)


def _followed_operand(op, sig, graph: Graph, free: set[int], arrays: list[int]) -> int | None:
    """The operand an op follows, or None when the op is a decision of its own."""
    if len(op.outputs) != 1 or op.name in HEAVY:
        return None
    live = [k for k in arrays if op.inputs[k] not in free and sig.inputs[k] is not None]
    if not live:
        return None
    if len([k for k in arrays if op.inputs[k] not in free]) == 1 or op.name in FOLLOW_FIRST:
        return live[0]
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Followed:
    """What a follower op adds to its lead node, per strategy of the node (`follow`), computed once
    per distinct question and added to each node that asks it (repeated layers ask the same).

    Attributes:
      costs: seconds added to `Node.costs` (its own cost plus the collectives before it).
      comm_s: seconds added to `Node.comm_s`.
      async_s: seconds added to `Node.async_s` (combinable ops; else zeros).
      groups: (kind, axes) groups joined (`Node.combined`).
      comms: (strategy, its collectives, their seconds) for the strategies with collectives only.
      out_specs: the follower's result spec per strategy.
      needs: per other array operand position, the spec the op reads it in, per strategy.
    """

    costs: tuple[float, ...]
    comm_s: tuple[float, ...]
    async_s: tuple[float, ...]
    groups: tuple[frozenset, ...]
    comms: tuple[tuple[int, list[Comm], list[float]], ...]
    out_specs: tuple[Spec, ...]
    needs: dict[int, tuple[Spec, ...]]


def _followed(sig, lead: int, specs: Sequence[Spec], ins, outs, cost: CostModel, combined: bool, traffic,
              others: Sequence[int], answers: dict | None = None, key: tuple = ()) -> _Followed:
    """`_Followed` of one follower op for its lead node's `specs`. `answers` (with the question's
    `key` without the spec) caches the answer per lead spec: lead nodes of different strategy lists
    share most of their specs."""
    costs, comm_s, async_s, groups, comms, out_specs = [], [], [], [], [], []
    needs: dict[int, list[Spec]] = {k: [] for k in others}
    answers = {} if answers is None else answers
    for i, spec in enumerate(specs):
        found = answers.get((key, spec))
        if found is None:
            strat, pre = follow(sig, lead, spec, ins, outs, cost, combined, traffic)
            times = ([cost.collective_time(kd, b, a) for kd, a, b in pre]
                     + [cost.collective_time(kd, b, a, combined) for kd, a, b in strat.comms])
            pre_s = sum(times[: len(pre)])
            found = answers[(key, spec)] = (
                strat.cost + pre_s, strat.comm_time + pre_s, strat.comm_time if combined else 0.0,
                _groups(strat.comms) if combined else frozenset(),
                (list(pre) + list(strat.comms), times) if pre or strat.comms else None, strat.out_specs[0],
                tuple(strat.in_specs[k] if strat.in_specs[k] is not None else ((),) * len(ins[k].shape)
                      for k in others))
        cost_s, comm, hideable, group, collectives, out_spec, need = found
        costs.append(cost_s)
        comm_s.append(comm)
        async_s.append(hideable)
        groups.append(group)
        if collectives is not None:
            comms.append((i, list(collectives[0]), collectives[1]))
        out_specs.append(out_spec)
        for k, n in zip(others, need):
            needs[k].append(n)
    return _Followed(tuple(costs), tuple(comm_s), tuple(async_s), tuple(groups), tuple(comms), tuple(out_specs),
                     {k: tuple(v) for k, v in needs.items()})


def _sig_key(sig) -> tuple:
    """What of an op's signature its strategies depend on (`where` only names it in errors)."""
    return (sig.inputs, sig.outputs, tuple(sorted(sig.sizes.items())), sig.sum_labels, sig.flops, sig.known,
            sig.pinned, sig.rate_dtypes)


def _groups(comms: Sequence[Comm]) -> frozenset[tuple[str, tuple[int, ...]]]:
    """The (kind, axes) groups of combinable collectives (XLA's combiners merge each group into one)."""
    return frozenset((kind, tuple(sorted(axes))) for kind, axes, _ in comms)
