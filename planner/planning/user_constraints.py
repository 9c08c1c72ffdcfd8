"""The record of a step's own sharding constraints: the user's spec beside the planned one."""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

from planner.core.compat import USER_CONSTRAINTS, user_sharding
from planner.core.plan import Plan
from planner.core.plan_records import UserConstraint
from planner.core.sharding import to_partition_spec
from planner.graph.ir import Graph


def _axes(entry, mesh) -> tuple[str, ...]:
    """A PartitionSpec entry as the mesh axes (of more than one device) that split the dim."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(n for n in names if n not in mesh.axis_names or mesh.shape[mesh.axis_names.index(n)] > 1)


def record_user_constraints(graph: Graph, plan: Plan) -> Plan:
    """The plan with its record of the step's own sharding constraints: the user's spec, the
    planned one, and whether they agree (always, when pinned)."""
    planned = {op: spec for op, k, spec in plan.op_specs if k == 0}
    out = []
    for op in graph.ops:
        if op.name not in USER_CONSTRAINTS or op.index not in planned:
            continue
        user = user_sharding(op.params).spec
        got = to_partition_spec(planned[op.index], plan.mesh)
        rank = len(graph.tensors[op.outputs[0]].shape)
        pad = lambda p: tuple(p) + (None,) * (rank - len(p))  # noqa: E731
        kept = all(u is PartitionSpec.UNCONSTRAINED or _axes(u, plan.mesh) == _axes(g, plan.mesh)
                   for u, g in zip(pad(user), pad(got)))
        out.append(UserConstraint(f"{op.name} {op.name_stack}".strip(), str(user), str(PartitionSpec(*pad(got))),
                                  kept, graph.user_constraints))
    return dataclasses.replace(plan, user_constraints=tuple(out)) if out else plan
