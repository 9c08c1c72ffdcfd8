"""From a traced graph and a mesh to a Plan: build the ILP, solve it, read the answer back out."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import jax

from planner.cost_model import Cluster, CostModel, get_hardware, hardware_with_links, ring_bytes, xla_flags
from planner.core.errors import InvalidArgumentError, MeshError
from planner.graph.ir import Graph
from planner.ilp.kernel_rules import kernel_notes
from planner.ilp.objective import step_parts, step_time
from planner.ilp.problem import Problem, build_problem
from planner.ilp.solver import Solution, solve
from planner.ilp.strategies import int8_payload, reshard_cost
from planner.ilp.wire import CONTRACTIONS, accumulates, before_reduction, block_for, gradient_chunks, rounds_once
from planner.core.mesh import MeshSpec
from planner.ilp.offload import plan_offload, record as offload_record
from planner.core.options import PlanOptions
from planner.core.plan import Decision, Plan, PredictedCollective, Prediction, WireFormat
from planner.core.plan_records import ArgumentReshard, Levers, SolverStats, Unbudgeted
from planner.core.sharding import Spec, active_axes, replicated
from planner.core.units import format_bytes

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


def cost_model_for(mesh: MeshSpec, options: PlanOptions, memo: dict | None = None) -> CostModel:
    """Analytic model from `options.hardware` / `inter_host_axes` and the link speeds
    `inter_host` / `intra_host`, or measured from `options.profile`, pricing collectives in the
    wire formats `options.comm_precision` allows. `memo`: the caller's models by mesh and options,
    one made per pair (the ILPs priced with one share its memos, `CostModel.part_times`)."""
    if memo is not None:
        found = memo.get((mesh, options))
        if found is None:
            found = memo[mesh, options] = cost_model_for(mesh, options)
        return found
    model = _cost_model(mesh, options)
    if model.comm_precision != options.comm_precision:
        model = dataclasses.replace(model, comm_precision=options.comm_precision)
    return model


def _cost_model(mesh: MeshSpec, options: PlanOptions) -> CostModel:
    check_options(options)
    hardware = options.hardware
    if options.inter_host is not None or options.intra_host is not None:
        if Cluster.is_cluster(hardware):
            cluster = Cluster.parse(hardware)
            linked = hardware_with_links(cluster.hardware, options.inter_host, options.intra_host,
                                         cluster.topo.devices_per_host)
            if cluster.topology is not None and options.profile is None and mesh.size <= cluster.num_devices:
                return CostModel.on_topology(mesh, cluster.with_links(linked))
            if cluster.num_devices == mesh.size and not options.inter_host_axes and options.profile is None:
                return CostModel.for_cluster(mesh, dataclasses.replace(cluster, hardware=linked))
            hardware = linked
        else:
            hardware = hardware_with_links(hardware, options.inter_host, options.intra_host)
    return CostModel.build(mesh, hardware, options.inter_host_axes, options.profile)


def _device_platform(jax_mesh) -> str:
    """The platform of the devices a plan compiles for ("" when planning has none: the memory
    model then assumes the hardware preset's platform)."""
    if isinstance(jax_mesh, jax.sharding.Mesh) and jax_mesh.devices.size:
        return str(jax_mesh.devices.flat[0].platform)
    return ""


def _argument_reshards(problem: Problem, choice: Sequence[int]) -> tuple[ArgumentReshard, ...]:
    """(op, operand position, tensor id, seconds, bytes moved per device) of every resharding that
    takes an argument (or a value its node computes from it alone, e.g. a parameter's bfloat16
    cast) to the layout an op reads it in (`_edge_comms`): the edge's time in the objective and its
    collectives' ring bytes, as the prediction counts them."""
    mesh = problem.cost.mesh
    return tuple(ArgumentReshard(e.op, e.pos, e.tensor, seconds,
                                 int(sum(ring_bytes(kind, nbytes, mesh.axis_size(axes)) for kind, axes, nbytes
                                         in comms if mesh.axis_size(axes) > 1)))
                 for e, comms, seconds in _edge_comms(problem, choice)
                 if e.op >= 0 and seconds > 0 and problem.nodes[e.src].label.split()[0] == "input")


def _edge_comms(problem: Problem, choice: Sequence[int]):
    """(edge, its collectives, its time) for every edge that reshards; the time is the ILP's."""
    for e in problem.edges:
        src, dst = e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]]
        if src == dst:
            continue
        comms, seconds = reshard_cost(problem.priced(e.tensor, e.op), src, dst, problem.cost)
        if comms:
            yield e, comms, seconds


def _predict(problem: Problem, sol: Solution) -> Prediction:
    """The plan's prediction: the ILP's objective (`objective.step_time`, one code path) split into
    compute and communication, with the collectives it counts."""
    mesh = problem.cost.mesh
    collectives: list[PredictedCollective] = []

    def add(kind, axes, nbytes, where, reason):
        n = mesh.axis_size(axes)
        if n > 1:
            collectives.append(PredictedCollective(kind, tuple(mesh.axis_names[a] for a in axes), int(nbytes), n,
                                                   where, reason))

    for node in problem.nodes:
        for kind, axes, nbytes in node.comms[sol.choice[node.index]]:
            add(kind, axes, nbytes, node.label, "partial sum" if kind in ("all-reduce", "reduce-scatter") else "follow")
    for e, comms, _ in _edge_comms(problem, sol.choice):
        for kind, axes, nbytes in comms:
            add(kind, axes, nbytes, problem.nodes[e.dst].label, "reshard")
    t = step_time(problem, sol.choice)
    moved = sum(ring_bytes(c.kind, c.nbytes, c.group_size) for c in collectives)
    return Prediction(t.total_s, t.compute_s, t.exposed_s, sol.peak_memory_bytes, moved, tuple(collectives),
                      t.hidden_s)


def _xla_flags(problem: Problem, choice: Sequence[int]) -> tuple[str, ...]:
    """The flags the prediction assumes: overlap only where some gradient reduction hides."""
    if not problem.overlap or step_time(problem, choice).hidden_s <= 0:
        return ()
    largest = max((b for n in problem.nodes for (kind, axes, b) in n.comms[choice[n.index]]
                   if n.async_s[choice[n.index]] > 0), default=0)
    return xla_flags(problem.cost.hardware, True, largest)


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
            comm += node.comm_s[option]
            compute += node.costs[option] - node.comm_s[option]
            for e in incident[n]:
                reshard += problem.edge_time(e.tensor, e.src_specs[trial[e.src]], e.dst_specs[trial[e.dst]], e.op)
        return compute, comm, reshard

    def local(rep: int, option: int) -> float:
        return sum(split(rep, option))

    names = problem.cost.mesh.axis_names

    def collectives(rep: int, option: int) -> tuple:
        """The rep op's own collectives under `option`, costed as `split` costs them."""
        node = problem.nodes[rep]
        return tuple((k, tuple(names[i] for i in a), int(b), t)
                     for (k, a, b), t in zip(node.comms[option], node.comm_times[option]))

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
        out.append(Decision(node.label, chosen_text, base, alt_text, alt[0] - base, len(group), compute, comm, reshard,
                            collectives(rep, chosen), collectives(rep, alt[1])))
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


def donated_inputs(graph: Graph, argnums: Sequence[int]) -> frozenset[int]:
    """Input tensor ids of the leaves of the arguments at positions `argnums` (paths "[i]...")."""
    heads = tuple(f"[{i}]" for i in argnums)
    return frozenset(t for t, path in zip(graph.inputs, graph.input_paths) if path.startswith(heads))


def overlaps(mesh: MeshSpec, options: PlanOptions, cost: CostModel | None = None) -> bool:
    """Whether plans on `mesh` price collectives as overlapping compute: `options.overlap`, and never
    on XLA:CPU, whose collectives are synchronous (`cost`: `cost_model_for(mesh, options)`, when made)."""
    return options.overlap and (cost or cost_model_for(mesh, options)).hardware.platform != "cpu"


def plan_problem(graph: Graph, mesh: MeshSpec, options: PlanOptions, jax_mesh: jax.sharding.Mesh | None = None,
                 pins: Mapping[int, Spec] | None = None,
                 allowed: Mapping[int, frozenset[Spec]] | None = None, cost: CostModel | None = None) -> Problem:
    """The ILP `make_plan` solves for `graph` on `mesh` (the mesh search bounds it before solving);
    `allowed` restricts it to a neighbourhood of specs (`ilp.problem.build_problem`); `cost`:
    `cost_model_for(mesh, options)` where the caller made it (its ILPs then share its memos).

    Raises:
      MeshError: a mesh axis that can split nothing.
    """
    t0 = time.perf_counter()
    check_mesh_fits(graph, mesh)
    cost = cost if cost is not None else cost_model_for(mesh, options)
    pinned = {graph.inputs[i]: spec for i, spec in (pins or {}).items()}
    problem = build_problem(graph, cost, tie_outputs=options.tie_outputs, share_layers=options.share_layers,
                            pins=pinned, donated_inputs=donated_inputs(graph, options.donate_argnums),
                            device_platform=_device_platform(jax_mesh), allowed=allowed)
    overlap = overlaps(mesh, options, cost)
    problem = dataclasses.replace(problem, overlap=overlap, prefetch=overlap and options.planned_prefetch)
    log.info("built ILP: %d ops -> %d decisions (%d after layer sharing), %d edges in %.2fs", len(graph.ops),
             len(problem.nodes), len(set(problem.rep)), len(problem.edges), time.perf_counter() - t0)
    return problem


def make_plan(graph: Graph, mesh: MeshSpec, options: PlanOptions, jax_mesh: jax.sharding.Mesh | None = None,
              pins: Mapping[int, Spec] | None = None, problem: Problem | None = None,
              min_peak_search: bool = True, start: Sequence[int] | None = None, lp_level: int = 1,
              beat: Callable[[], float] | None = None, gap: float = 0.0, microbatches: int = 1,
              whole_axes: frozenset[int] = frozenset()) -> Plan:
    """Plans `graph` on `mesh`; `pins` (input position -> spec, `planner.configs.pins.resolve`) fix those
    inputs' shardings and the ILP plans the rest. `problem`: `plan_problem`'s answer for the same
    arguments, when the caller built it already. `min_peak_search=False`: an infeasible budget is
    reported without searching for the smallest peak (the mesh search runs that search once, on
    its most promising mesh). `start`: a choice for `problem` to start the solver from
    (`ilp.solver.solve`). `lp_level`, `gap`: the solver's LP relaxation level and the relative gap
    it stops at (`ilp.solver.solve`).
    `beat`: a step time found elsewhere, read as the solver goes (`ilp.solver.solve`); the solve
    stops with `OutboundError` once it proves no plan beats it. Without host offload only (with it,
    the offload variants tried may differ in time either way).
    `microbatches`: `graph` is one of this many microbatches of a step that reduces its gradients
    once (a pipeline stage's layer, `stages.layer_cost`): the solver weighs the gradient all-reduces
    at 1/microbatches of their time, exposed (`reductions_weighed`), so that a layout is chosen for
    the whole step; the prediction still prices this one microbatch with them in full (the caller
    takes them out to once per step; `Plan.solver.weighed_once_s` holds their full time in the
    chosen plan, so its objective at another count is known). `whole_axes`: mesh axes over which
    no all-reduce is weighed down (the runtime runs them every microbatch: a stage's parameters
    split over them).

    Raises:
      MeshError: a mesh axis that can split nothing.
      InfeasiblePlanError: no plan fits `options.memory_budget`.
    """
    t0 = time.perf_counter()
    if problem is None:
        problem = plan_problem(graph, mesh, options, jax_mesh, pins)
    once_s = None
    if microbatches > 1:
        weighed = reductions_weighed(problem, 1.0 / microbatches, whole_axes)
        solved, sol = _solve(weighed, options, jax_mesh, min_peak_search, start, lp_level, beat, gap)
        once_s = _weighed_once(problem, weighed, sol.choice, 1.0 / microbatches)
        problem = dataclasses.replace(solved, nodes=problem.nodes)  # priced in full (the solve's choice)
    else:
        problem, sol = _solve(problem, options, jax_mesh, min_peak_search, start, lp_level, beat, gap)
    op_specs = _op_specs(graph, problem, sol.choice)
    operand_specs = _operand_specs(problem, sol.choice)
    scatter_specs = _scatter_specs(graph, problem, sol.choice)
    in_specs = tuple(problem.spec(t, sol.choice) for t in graph.inputs)
    out_specs = _output_specs(graph, problem, sol.choice)
    prediction = _predict(problem, sol)
    solver_info = _solver_info(graph, problem, sol, t0, pins)
    if once_s is not None:
        solver_info = dataclasses.replace(solver_info, weighed_once_s=once_s)
    levers = Levers(offload=offload_record(problem, sol.choice, options.planned_offload) if options.planned_offload != "off" else None)
    return Plan(
        mesh=mesh,
        input_paths=graph.input_paths,
        input_specs=in_specs,
        output_paths=graph.output_paths,
        output_specs=out_specs,
        op_specs=op_specs,
        prediction=prediction,
        decisions=_decisions(problem, sol.choice),
        solver=solver_info,
        options=options.recorded(),
        fallback_primitives=problem.fallback_primitives,
        scatter_specs=scatter_specs,
        operand_specs=operand_specs,
        in_tree=graph.in_tree,
        out_tree=graph.out_tree,
        jax_mesh=jax_mesh,
        assumed_xla_flags=_xla_flags(problem, sol.choice),
        levers=levers,
        wire=_wire_formats(graph, problem, sol.choice),
        kernels=graph.cached(("kernel_notes", problem.cost.hardware.platform),
                             lambda: kernel_notes(graph, problem.cost.hardware.platform)),
    )


def reductions_weighed(problem: Problem, share: float, whole_axes: frozenset[int] = frozenset()) -> Problem:
    """`problem` with each strategy's combinable all-reduces (the gradient reductions that leave the
    gradient whole over their axes, among `Node.async_s`) and their int8 quantisation
    (`Node.quantise_s`) costing `share` of their time, exposed: paid once per step after the last
    microbatch, where nothing is left to hide them behind (`stages.candidate.once_per_step_max`).
    A reduce-scatter keeps its full time: it splits the gradient, and so its parameter, over its
    axes, and a pipeline stage with a parameter split over a data axis reduces every microbatch
    (`stages.stage_columns.split_ranges`). Each (kind, axes) group's latency stays whole (it is paid
    once anyway). An all-reduce over any of `whole_axes` keeps its whole time."""
    nodes = []
    for node in problem.nodes:
        if not any(node.async_s):
            nodes.append(node)
            continue
        once = [min(a, sum(t for (kind, axes, _), t in zip(comms, times)
                           if kind == "all-reduce" and not whole_axes.intersection(axes)))
                for a, comms, times in zip(node.async_s, node.comms, node.comm_times)]
        scatters = [any(kind == "reduce-scatter" for kind, _, _ in comms) for comms in node.comms]
        quantised = [0.0 if rs else q for q, rs in zip(node.quantise_s, scatters)]
        cut = [(o + q) * (1.0 - share) for o, q in zip(once, quantised)]
        nodes.append(dataclasses.replace(node, costs=[c - d for c, d in zip(node.costs, cut)],
                                         comm_s=[c - o * (1.0 - share) for c, o in zip(node.comm_s, once)],
                                         async_s=[a - o for a, o in zip(node.async_s, once)],
                                         quantise_s=[q - qq * (1.0 - share) for q, qq in zip(node.quantise_s, quantised)]))
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _weighed_once(full: Problem, weighed: Problem, choice: Sequence[int], share: float) -> float | None:
    """The full seconds of what `reductions_weighed` weighed at `share` in the chosen strategies, or
    None where the chosen plan weighed int8 quantisation: its time counts as compute in the overlap
    term, so the objective is not affine in the share there (without it only the costs and
    exposed collectives move with the share, the hidden capacity does not)."""
    once = quantised = 0.0
    for node, w, c in zip(full.nodes, weighed.nodes, choice):
        if not node.async_s:
            continue
        o = (node.comm_s[c] - w.comm_s[c]) / (1.0 - share)
        once += o
        quantised += (node.costs[c] - w.costs[c]) / (1.0 - share) - o
    return None if quantised > 1e-12 else once


def _solve(problem: Problem, options: PlanOptions, jax_mesh: jax.sharding.Mesh | None, min_peak_search: bool,
           start: Sequence[int] | None, lp_level: int, beat: Callable[[], float] | None,
           gap: float = 0.0) -> tuple[Problem, Solution]:
    """`make_plan`'s solve, with host offload of optimizer state (`planner.ilp.offload`; "off": a
    plain solve): the problem solved (with its offload choice) and its solution."""
    problem, sol = plan_offload(
        problem, options.planned_offload, options.memory_budget,
        list(jax_mesh.devices.flat) if isinstance(jax_mesh, jax.sharding.Mesh) else [],
        lambda p, search: solve(p, options.memory_budget, options.solver_time_limit, options.solver_workers,
                                min_peak_search=min_peak_search and search, begin=start if p is problem else None,
                                lp_level=lp_level, beat=beat if options.planned_offload == "off" else None, gap=gap))
    log.info("solved: %s in %.2fs, predicted %.4g s/step, peak %s/device", sol.status, sol.solve_time_s,
             sol.objective_s, format_bytes(sol.peak_memory_bytes))
    return problem, sol


def _op_specs(graph: Graph, problem: Problem, choice: Sequence[int]) -> tuple:
    """(op, output position, spec) of each op result the plan lays out: its node's choice, or for a
    result only read (`Node.free_requires`), the layout its readers can each slice from (`_common`)."""
    producers = graph.producers()
    op_specs = []
    for tid, node in sorted(problem.owner.items()):
        if tid in producers:
            op, k = producers[tid]
            op_specs.append((op, k, problem.nodes[node].owned[tid][choice[node]]))
    wanted_free: dict[int, list] = defaultdict(list)
    for node in problem.nodes:
        for tid, specs in node.free_requires:
            wanted_free[tid].append(specs[choice[node.index]])
    for tid, specs in sorted(wanted_free.items()):
        if tid in producers:
            op, k = producers[tid]
            op_specs.append((op, k, _common(specs)))
    return tuple(sorted(op_specs))


def _operand_specs(problem: Problem, choice: Sequence[int]) -> tuple:
    """(op, operand position, spec) of each operand an op reads resharded."""
    operand_specs = []
    for e in problem.edges:
        src, dst = e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]]
        if src != dst and e.op >= 0:
            operand_specs.append((e.op, e.pos, dst))
    return tuple(sorted(set(operand_specs)))


def _wire_formats(graph: Graph, problem: Problem, choice: Sequence[int]) -> tuple[WireFormat, ...]:
    """The collectives the plan runs in another dtype than their values' (`planner.ilp.wire`): the
    partial sums of each split contraction that accumulates wider than its result, under
    comm_precision "exact"; each quantised weight read that gathers."""
    found: set[WireFormat] = set(_int8_reductions(graph, problem, choice))
    if problem.cost.comm_precision == "exact":
        for node in problem.nodes:
            i = choice[node.index]
            for (kind, _, _), at in zip(node.comms[i], node.comm_ops[i]):
                op = graph.ops[at] if at >= 0 else None
                if (kind in ("all-reduce", "reduce-scatter") and op is not None and op.name in CONTRACTIONS
                        and rounds_once(graph.tensors[op.outputs[0]].dtype)):
                    found.add(WireFormat("partial-sum", at, 0, accumulates(graph.tensors[op.outputs[0]].dtype)))
    for e, comms, _ in _edge_comms(problem, choice) if problem.quantized else ():
        if (e.tensor, e.op) in problem.quantized and any(kind == "all-gather" for kind, _, _ in comms):
            found.add(WireFormat("gather", e.op, e.pos, "int8", block_for(graph.tensors[e.tensor], problem.cost.mesh.size)))
    return tuple(sorted(found, key=lambda w: (w.op, w.kind, w.pos)))


def _int8_reductions(graph: Graph, problem: Problem, choice: Sequence[int]) -> list[WireFormat]:
    """The gradient reductions the plan exchanges as int8 chunks under comm_precision "int8": those
    whose chosen strategy is the int8 variant (`ilp.strategies.int8_reduction`: its collective
    carries the int8 payload): (op, the dimension cut, the axes)."""
    if problem.cost.comm_precision != "int8":
        return []
    found = []
    mesh = problem.cost.mesh
    for node in problem.nodes:
        i = choice[node.index]
        root = graph.ops[node.ops[0]] if node.ops else None
        if root is None or root.name not in CONTRACTIONS or root.index not in problem.combinable:
            continue
        for (kind, axes, nbytes), at in zip(node.comms[i], node.comm_ops[i]):
            if at != root.index or kind not in ("all-reduce", "reduce-scatter"):
                continue
            t = graph.tensors[root.outputs[0]]
            out = node.owned[root.outputs[0]][i]
            pre, scatter = before_reduction(out, axes)
            d = gradient_chunks(t.shape, pre, mesh.axis_size(axes), scatter)
            if accumulates(t.dtype) and d is not None and nbytes == int8_payload(t, pre, mesh):
                found.append(WireFormat("reduce", root.index, d, "int8", 0, tuple(axes)))
    return found


def _scatter_specs(graph: Graph, problem: Problem, choice: Sequence[int]) -> tuple:
    """(op, 0, spec) of each op whose result is reduce-scattered: its layout before the scatter."""
    scatter_specs = []
    for node in problem.nodes:
        i = choice[node.index]
        rs_axes = {a for kind, axes, _ in node.comms[i] if kind == "reduce-scatter" for a in axes}
        if rs_axes and node.label.split()[0] != "input":
            root = graph.ops[node.ops[0]]
            spec = node.owned[root.outputs[0]][i]
            pre = tuple(tuple(a for a in axes if a not in rs_axes) for axes in spec)
            scatter_specs.append((root.index, 0, pre))
    return tuple(sorted(scatter_specs))


def _output_specs(graph: Graph, problem: Problem, choice: Sequence[int]) -> tuple:
    """The spec of each output: pinned, as the plan lays it out, or replicated (a constant)."""
    return tuple(
        (problem.pinned_outputs[t] if isinstance(t, int) and t in problem.pinned_outputs
         else problem.spec(t, choice) if isinstance(t, int) else replicated(len(t.tensor.shape)))
        for t in graph.outputs
    )


def _solver_info(graph: Graph, problem: Problem, sol: Solution, t0: float,
                 pins: Mapping[int, Spec] | None) -> SolverStats:
    """`Plan.solver`: how the solve went, the problem's size, and the parts of the step time."""
    return SolverStats(
        status=sol.status,
        solve_time_s=round(sol.solve_time_s, 3),
        planning_time_s=round(time.perf_counter() - t0, 3),
        rounds=sol.rounds,
        ops=len(graph.ops),
        decisions=len(problem.nodes),
        variables_shared=len(set(problem.rep)),
        edges=len(problem.edges),
        objective_s=sol.objective_s,
        optimal=sol.optimal,
        gap=None if sol.gap is None else round(sol.gap, 6),
        deterministic_time=round(sol.deterministic_time, 3),
        limit=sol.limit,
        # what fitting the budget cost (`present.report.format_budget_cost`)
        unbudgeted=None if sol.unbudgeted is None else Unbudgeted(*sol.unbudgeted),
        pinned_inputs=len(pins) if pins else None,
        step_parts=step_parts(problem, sol.choice),
        # exposed: a loop over microbatches may do them once (`levers.accumulate.unshard`)
        argument_reshards=None if problem.prefetch else _argument_reshards(problem, sol.choice),
    )
