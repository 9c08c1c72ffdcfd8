"""Refinement: the finer meshes a mesh's plan carries to (two neighbouring axes split from one) and the
search near that plan on them."""
from __future__ import annotations

from collections.abc import Sequence

from planner.core.mesh import MeshSpec
from planner.core.plan import Plan
from planner.core.sharding import active_axes
from planner.graph.ir import Graph
from planner.ilp.problem import Problem


REFINE_UNITS = 0.5  # deterministic units of a neighbourhood search on a mesh of three axes (`search_meshes`)


def coarsenings(shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
    """The meshes of one fewer axis a mesh refines, by merging two neighbouring axes: (coarse shape,
    for each coarse axis the fine axes it becomes). A plan on the coarse mesh is a plan on the fine
    one: splitting a dimension over the merged axis is splitting it over the two axes in order
    (devices laid out row-major, the same devices in the same order)."""
    out = []
    for k in range(len(shape) - 1):
        coarse = tuple(shape[:k]) + (shape[k] * shape[k + 1],) + tuple(shape[k + 2:])
        axes = tuple((a,) for a in range(k)) + ((k, k + 1),) + tuple((a + 1,) for a in range(k + 1, len(shape) - 1))
        out.append((coarse, axes))
    return out


def refined_choice(problem: Problem, plan: Plan, axes: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    """`plan` (made on a coarser mesh, `coarsenings`) as a choice of `problem`'s strategies: each
    decision takes the strategy that makes its results in the plan's shardings and reads its
    operands as the plan reads them, every coarse axis replaced by its fine axes (the cheapest such
    strategy, or of those making the results alike when none reads alike). None when some decision
    has no strategy making its results in the plan's shardings."""
    graph = problem.graph

    def fine(spec):
        return tuple(tuple(f for a in dim for f in axes[a]) for dim in spec)

    made = {t: fine(spec) for t, spec in zip(graph.inputs, plan.input_specs)}
    for op, k, spec in plan.op_specs:
        made[graph.ops[op].outputs[k]] = fine(spec)
    read = {(op, pos): fine(spec) for op, pos, spec in plan.operand_specs}
    choice = []
    for node in problem.nodes:
        alike = [j for j in range(len(node.costs))
                 if all(t not in made or specs[j] == made[t] for t, specs in node.owned.items())]
        if not alike:
            return None
        root = node.ops[0] if node.ops else None
        same = [j for j in alike if all(specs[j] == read.get((root, pos), made.get(t, specs[j]))
                                        for t, specs, pos in node.requires)]
        choice.append(min(same or alike, key=lambda j: node.costs[j]))
    return tuple(choice)


def neighbourhood(graph: Graph, plan: Plan, axes: Sequence[tuple[int, ...]], mesh: MeshSpec) -> dict[int, frozenset]:
    """The specs a finer mesh's search keeps near `plan` (made on the coarser mesh, `coarsenings`):
    per tensor the plan lays out, its spec (and the specs its readers read it in) with every
    coarse axis replaced by its fine axes (as `refined_choice` maps them), and every spec one
    active axis of `mesh` away from those (the axis taken out, moved to another dim, or added to a
    dim it did not split). Over these, `ilp.problem.build_problem(allowed=...)` builds a small ILP
    holding the plan itself and the layouts that use the split axes apart (e.g. batch over x*y,
    heads over z where the coarse plan splits heads over y*z)."""
    def fine(spec):
        return tuple(tuple(f for a in dim for f in axes[a]) for dim in spec)

    made = list(zip(graph.inputs, plan.input_specs))
    made += [(graph.ops[op].outputs[k], spec) for op, k, spec in plan.op_specs]
    read = [(graph.ops[op].inputs[pos], spec) for op, pos, spec in plan.operand_specs]  # where read resharded
    out: dict[int, frozenset] = {}
    near: dict = {}  # spec -> its neighbourhood (repeated layers repeat their specs)
    for t, spec in made + read:
        if isinstance(t, int):
            found = near.get(spec)
            if found is None:
                found = near[spec] = _one_axis_away(fine(spec), mesh)
            out[t] = out[t] | found if t in out else found
    return out


def _one_axis_away(spec, mesh: MeshSpec) -> frozenset:
    near = {spec}
    for a in active_axes(mesh):
        without = tuple(tuple(x for x in dim if x != a) for dim in spec)
        near.add(without)
        for d in range(len(spec)):
            near.add(tuple(tuple(sorted(dim + (a,))) if k == d else dim for k, dim in enumerate(without)))
    return frozenset(near)


def keeps_together(plan: Plan, pair: tuple[int, int]) -> bool:
    """Whether every spec of `plan` uses the two neighbouring mesh axes `pair` as one: both in one
    dim, the first right before the second, or neither (the plan is then a plan of the mesh with
    those axes merged)."""
    a, b = pair
    specs = list(plan.input_specs) + [spec for _, _, spec in plan.op_specs]
    for spec in specs:
        for dim in spec:
            if (a in dim) != (b in dim) or (a in dim and dim.index(b) != dim.index(a) + 1):
                return False
    return True
