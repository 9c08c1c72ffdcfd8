"""From a traced graph and a mesh to a Plan: build the ILP, solve it, read the answer back out."""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import jax

from planner.cost_model import CostModel, get_hardware, ring_bytes
from planner.errors import InvalidArgumentError, MeshError
from planner.graph import Graph
from planner.ilp.problem import Problem, build_problem
from planner.ilp.solver import Solution, solve
from planner.ilp.strategies import edge_time, reshard_cost
from planner.mesh import MeshSpec
from planner.options import PlanOptions
from planner.plan import Decision, Plan, PredictedCollective, Prediction
from planner.sharding import active_axes, replicated

log = logging.getLogger("planner")


def check_mesh_fits(graph: Graph, mesh: MeshSpec) -> None:
    """Rejects a mesh with an axis that divides no dimension of any input (it could never be used)."""
    for a in active_axes(mesh):
        size = mesh.shape[a]
        if not any(d % size == 0 for t in graph.inputs for d in graph.tensors[t].shape):
            shapes = sorted({graph.tensors[t].shape for t in graph.inputs})[:5]
            raise MeshError(
                f"mesh axis {mesh.axis_names[a]!r} of size {size} divides no dimension of any input "
                f"(input shapes include {shapes}); choose a mesh whose axis sizes divide the batch or model dims"
            )


def check_options(options: PlanOptions) -> PlanOptions:
    """`options` if the cost model can be built from them (a known hardware preset or cluster).

    Raises:
      InvalidArgumentError: naming the unknown preset and the known ones.
    """
    if options.hardware is not None:
        try:
            get_hardware(options.hardware)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
    return options


def cost_model_for(mesh: MeshSpec, options: PlanOptions) -> CostModel:
    """Analytic model from `options.hardware` / `inter_host_axes`, or measured from `options.profile`."""
    check_options(options)
    return CostModel.build(mesh, options.hardware, options.inter_host_axes, options.profile)


def _edge_comms(problem: Problem, choice: Sequence[int]):
    """(edge, its collectives, its time) for every edge that reshards; the time is the ILP's."""
    for e in problem.edges:
        src, dst = e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]]
        comms, seconds = reshard_cost(problem.graph.tensors[e.tensor], src, dst, problem.cost)
        if comms:
            yield e, comms, seconds


def _predict(problem: Problem, sol: Solution) -> Prediction:
    cost, mesh = problem.cost, problem.cost.mesh
    collectives: list[PredictedCollective] = []
    comm_time = 0.0
    compute_time = 0.0

    def add(kind, axes, nbytes, where, reason, combined=False, timed=True):
        nonlocal comm_time
        n = mesh.axis_size(axes)
        if n <= 1:
            return 0.0
        collectives.append(PredictedCollective(kind, tuple(mesh.axis_names[a] for a in axes), int(nbytes), n, where,
                                               reason))
        t = cost.collective_time(kind, nbytes, axes, combined) if timed else 0.0
        comm_time += t
        return t

    combined_latency: dict[tuple, float] = {}
    for node in problem.nodes:
        i = sol.choice[node.index]
        # Same convention as the ILP: reductions whose results feed no matmul are combined by XLA,
        # so they pay bandwidth each and latency once per (kind, axes) group.
        combined = bool(node.ops) and node.ops[0] in problem.combinable
        own_comm = 0.0
        for kind, axes, nbytes in node.comms[i]:
            reason = "partial sum" if kind in ("all-reduce", "reduce-scatter") else "follow"
            own_comm += add(kind, axes, nbytes, node.label, reason, combined)
            if combined:
                key = (kind, tuple(axes))
                combined_latency[key] = (cost.collective_time(kind, nbytes, axes)
                                         - cost.collective_time(kind, nbytes, axes, True))
        compute_time += max(0.0, node.costs[i] - own_comm)
    comm_time += sum(combined_latency.values())
    # Resharding time as the ILP priced it (`edge_time`: a multi-axis gather is timed part by part,
    # each on its own axis's link), not recomputed from the reported collectives.
    for e, comms, seconds in _edge_comms(problem, sol.choice):
        dst = problem.nodes[e.dst].label
        for kind, axes, nbytes in comms:
            add(kind, axes, nbytes, dst, "reshard", timed=False)
        comm_time += seconds
    moved = sum(ring_bytes(c.kind, c.nbytes, c.group_size) for c in collectives)
    return Prediction(compute_time + comm_time, compute_time, comm_time, sol.peak_memory_bytes, moved,
                      tuple(collectives))


def _decisions(problem: Problem, choice: Sequence[int], limit: int = 400) -> tuple[Decision, ...]:
    """For each distinct decision: the chosen strategy and the best alternative, costed locally
    (own cost + resharding on incident edges, all other choices fixed)."""
    members: dict[int, list[int]] = defaultdict(list)
    for n in range(len(problem.nodes)):
        members[problem.rep[n]].append(n)
    incident: dict[int, list] = defaultdict(list)
    for e in problem.edges:
        incident[e.src].append(e)
        incident[e.dst].append(e)

    def split(rep: int, option: int) -> tuple[float, float, float]:
        """(compute, own communication, resharding on incident edges) of `option` for all members."""
        compute = comm = reshard = 0.0
        trial = list(choice)
        for n in members[rep]:
            trial[n] = option
        for n in members[rep]:
            node = problem.nodes[n]
            combined = bool(node.ops) and node.ops[0] in problem.combinable
            own = sum(problem.cost.collective_time(k, b, a, combined) for k, a, b in node.comms[option])
            comm += own
            compute += max(0.0, node.costs[option] - own)
            for e in incident[n]:
                t = problem.graph.tensors[e.tensor]
                reshard += edge_time(t, e.src_specs[trial[e.src]], e.dst_specs[trial[e.dst]], problem.cost)
        return compute, comm, reshard

    def local(rep: int, option: int) -> float:
        return sum(split(rep, option))

    out = []
    for rep, group in members.items():
        node = problem.nodes[rep]
        if node.size <= 1 or len(out) >= limit:
            continue
        chosen = choice[rep]
        costs = [(local(rep, i), i) for i in range(node.size)]
        base = costs[chosen][0]
        alt = min((c for c in costs if c[1] != chosen), default=(base, chosen))
        spec_of = {t: v[chosen] for t, v in node.owned.items()}
        first = next(iter(spec_of.values()), None)
        chosen_text = node.descriptions[chosen] or (str(first) if first is not None else "")
        alt_node_spec = next(iter(node.owned.values()))[alt[1]] if node.owned else None
        alt_text = node.descriptions[alt[1]] or str(alt_node_spec)
        compute, comm, reshard = split(rep, chosen)
        out.append(Decision(node.label, chosen_text, base, alt_text, alt[0] - base, len(group), compute, comm, reshard))
    return tuple(out)


def _common(specs: Sequence) -> tuple:
    """Per dim, the leading mesh axes every spec agrees on: a layout each consumer can slice from."""
    out = []
    for dims in zip(*specs):
        common: list[int] = []
        for axes in zip(*dims):
            if len(set(axes)) != 1:
                break
            common.append(axes[0])
        out.append(tuple(common))
    return tuple(out)


def make_plan(graph: Graph, mesh: MeshSpec, options: PlanOptions, jax_mesh: jax.sharding.Mesh | None = None) -> Plan:
    """Plans `graph` on `mesh`.

    Raises:
      MeshError: a mesh axis that can split nothing.
      InfeasiblePlanError: no plan fits `options.memory_budget`.
    """
    t0 = time.perf_counter()
    check_mesh_fits(graph, mesh)
    cost = cost_model_for(mesh, options)
    problem = build_problem(graph, cost, tie_outputs=options.tie_outputs, share_layers=options.share_layers)
    t1 = time.perf_counter()
    log.info("built ILP: %d ops -> %d decisions (%d after layer sharing), %d edges in %.2fs", len(graph.ops),
             len(problem.nodes), len(set(problem.rep)), len(problem.edges), t1 - t0)
    sol = solve(problem, options.memory_budget, options.solver_time_limit, options.solver_workers)
    log.info("solved: %s in %.2fs, predicted %.4g s/step, peak %.4g B/device", sol.status, sol.solve_time_s,
             sol.objective_s, sol.peak_memory_bytes)
    producers = graph.producers()
    op_specs = []
    for tid, node in sorted(problem.owner.items()):
        if tid in producers:
            op, k = producers[tid]
            op_specs.append((op, k, problem.nodes[node].owned[tid][sol.choice[node]]))
    wanted_free: dict[int, list] = defaultdict(list)
    for node in problem.nodes:
        for tid, specs in node.free_requires:
            wanted_free[tid].append(specs[sol.choice[node.index]])
    for tid, specs in sorted(wanted_free.items()):
        if tid in producers:
            op, k = producers[tid]
            op_specs.append((op, k, _common(specs)))
    operand_specs = []
    for e in problem.edges:
        src, dst = e.src_specs[sol.choice[e.src]], e.dst_specs[sol.choice[e.dst]]
        if src != dst:
            operand_specs.append((e.op, e.pos, dst))
    scatter_specs = []
    for node in problem.nodes:
        i = sol.choice[node.index]
        rs_axes = {a for kind, axes, _ in node.comms[i] if kind == "reduce-scatter" for a in axes}
        if rs_axes and node.label.split()[0] != "input":
            root = graph.ops[node.ops[0]]
            spec = node.owned[root.outputs[0]][i]
            pre = tuple(tuple(a for a in axes if a not in rs_axes) for axes in spec)
            scatter_specs.append((root.index, 0, pre))
    in_specs = tuple(problem.spec(t, sol.choice) for t in graph.inputs)
    out_specs = tuple(
        (problem.spec(t, sol.choice) if isinstance(t, int) else replicated(len(t.tensor.shape)))
        for t in graph.outputs
    )
    prediction = _predict(problem, sol)
    solver_info = {
        "status": sol.status,
        "solve_time_s": round(sol.solve_time_s, 3),
        "planning_time_s": round(time.perf_counter() - t0, 3),
        "rounds": sol.rounds,
        "ops": len(graph.ops),
        "decisions": len(problem.nodes),
        "variables_shared": len(set(problem.rep)),
        "edges": len(problem.edges),
        "objective_s": sol.objective_s,
    }
    return Plan(
        mesh=mesh,
        input_paths=graph.input_paths,
        input_specs=in_specs,
        output_paths=graph.output_paths,
        output_specs=out_specs,
        op_specs=tuple(sorted(op_specs)),
        prediction=prediction,
        decisions=_decisions(problem, sol.choice),
        solver=solver_info,
        options=options.to_json(),
        fallback_primitives=problem.fallback_primitives,
        scatter_specs=tuple(sorted(scatter_specs)),
        operand_specs=tuple(sorted(set(operand_specs))),
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
        jax_mesh=jax_mesh,
    )
