"""The ILP's objective is the plan's predicted step time (planner/ilp/objective.py): CP-SAT's own
value, the solver's progress line and the prediction are one number; combined gradient reductions
pay one latency; communication hides behind compute (gradient all-reduces behind the backward,
prefetched parameter gathers) as hand schedules say."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from ortools.sat.python import cp_model

from planner.cost_model import CostModel, get_hardware
from planner.cost_model.collectives import ring_bytes, ring_steps
from planner.graph.trace import trace
from planner.ilp.problem import build_problem
from planner.ilp.cpsat import _Model, plan_cost
from planner.ilp.ticks import _NS
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.search.mesh_plan import cost_model_for, make_plan
from tests.helpers import TALL, zoo_graph

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))
MESH_8 = MeshSpec((8,), ("x",))


def _cp_sat_optimum(problem):
    """CP-SAT's own optimum of the planner's model of `problem`: (objective in seconds, the choice,
    the rounding tolerance: each objective term is rounded to one 10 ps tick)."""
    model = _Model(problem)
    model.m.Minimize(model.objective)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 20
    assert solver.Solve(model.m) == cp_model.OPTIMAL
    choice = [next(i for i, v in enumerate(vs) if isinstance(v, int) or solver.BooleanValue(v)) for vs in model.x]
    return solver.ObjectiveValue() / _NS, choice, (model.rounded_terms + 1) / _NS


def test_solver_objective_progress_line_and_prediction_are_one_number():
    """mlp-tiny on 2x4: the bias gradients are follower reductions of nodes that are not themselves
    combinable (where the solver's progress line once fell below its mesh line). CP-SAT's own
    objective value, `Solution.objective_s` (the progress line) and the plan's prediction agree."""
    graph = zoo_graph("mlp-tiny")
    options = PlanOptions(solver_time_limit=20)
    plan = make_plan(graph, MESH_2x4, options)
    p = plan.prediction
    assert plan.solver.objective_s == pytest.approx(p.step_time_s, rel=1e-12)
    assert p.step_time_s == pytest.approx(p.compute_time_s + p.communication_time_s, rel=1e-12)

    problem = build_problem(graph, cost_model_for(MESH_2x4, options))
    objective, choice, rounding = _cp_sat_optimum(problem)
    assert objective == pytest.approx(plan_cost(problem, choice), abs=rounding)
    assert objective == pytest.approx(p.step_time_s, abs=rounding)  # same optimum


def test_combined_gradient_reductions_pay_one_latency():
    """Batch >> hidden MLP on 8 devices: pure data parallelism, every gradient all-reduced and
    combined by XLA: the prediction is the ring bandwidth of each gradient plus one ring latency,
    by hand from the preset's link figures."""
    graph = zoo_graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    plan = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, overlap=False))
    hw = get_hardware(None)
    reduces = [c for c in plan.prediction.collectives if c.kind == "all-reduce"]
    params = {t.nbytes for t in (graph.tensors[i] for i in graph.inputs)}
    assert reduces and all(c.nbytes in params for c in reduces)  # gradients only: data parallel
    assert not [c for c in plan.prediction.collectives if c.kind != "all-reduce"]
    hand = (sum(ring_bytes("all-reduce", c.nbytes, 8) for c in reduces) / hw.intra_bandwidth
            + ring_steps("all-reduce", 8) * hw.intra_latency)
    assert plan.prediction.communication_time_s == pytest.approx(hand, rel=1e-9)
    assert CostModel.default(MESH_8).collective_latency("all-reduce", (0,)) == pytest.approx(14 * hw.intra_latency)



def test_a_plan_for_several_microbatches_weighs_its_gradient_all_reduces_once_per_step():
    """The data-parallel MLP on 8 devices planned as one of 16 microbatches (`microbatches=16`, a
    pipeline stage's layer): the solver's objective counts each gradient all-reduce at 1/16 of its
    time, exposed, its group latencies whole; the prediction still prices the microbatch with them
    in full (the caller moves them to once per step), which is the plain plan's prediction."""
    from planner.search.mesh_plan import plan_problem, reductions_weighed
    from planner.ilp.objective import step_time

    graph = zoo_graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    options = PlanOptions(solver_time_limit=20, overlap=False)
    one = make_plan(graph, MESH_8, options)
    many = make_plan(graph, MESH_8, options, microbatches=16)
    assert many.input_specs == one.input_specs  # data parallel either way
    assert many.prediction.step_time_s == pytest.approx(one.prediction.step_time_s, rel=1e-12)
    hw = get_hardware(None)
    reduces = [c for c in one.prediction.collectives if c.kind == "all-reduce"]
    bandwidth = sum(ring_bytes("all-reduce", c.nbytes, 8) for c in reduces) / hw.intra_bandwidth
    assert reduces and many.solver.objective_s == pytest.approx(one.solver.objective_s - bandwidth * 15 / 16, rel=1e-9)
    # a reduce-scatter (the gradient split, and so its parameter) keeps its whole time
    problem = plan_problem(graph, MESH_8, options)
    weighed = reductions_weighed(problem, 1 / 16)
    for old, new in zip(problem.nodes, weighed.nodes):
        for i, comms in enumerate(old.comms):
            if old.async_s[i] and all(kind == "reduce-scatter" for kind, _, _ in comms):
                assert new.costs[i] == old.costs[i] and new.async_s[i] == old.async_s[i]
    assert any(n.async_s[i] and any(k == "reduce-scatter" for k, _, _ in n.comms[i])
               for n in problem.nodes for i in range(n.size))
    assert step_time(weighed, [0] * len(weighed.nodes)).total_s <= step_time(problem, [0] * len(problem.nodes)).total_s


def test_a_plan_for_several_microbatches_keeps_all_reduces_over_whole_axes_whole():
    """`make_plan(microbatches=, whole_axes=)` (a hand layout's layer: its parameters' axes): an
    all-reduce over one of those axes keeps its whole time in the solve (the runtime runs it every
    microbatch), the others are weighed as before. The data-parallel MLP on 8 devices: with its one
    axis whole the objective and the problem's costs are the plain plan's."""
    from planner.search.mesh_plan import plan_problem, reductions_weighed

    graph = zoo_graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    options = PlanOptions(solver_time_limit=20, overlap=False)
    one = make_plan(graph, MESH_8, options)
    whole = make_plan(graph, MESH_8, options, microbatches=16, whole_axes=frozenset({0}))
    weighed = make_plan(graph, MESH_8, options, microbatches=16)
    assert whole.input_specs == one.input_specs
    assert whole.solver.objective_s == pytest.approx(one.solver.objective_s, rel=1e-12)
    assert weighed.solver.objective_s < one.solver.objective_s  # the reductions weighed without it
    problem = plan_problem(graph, MESH_8, options)
    kept = reductions_weighed(problem, 1 / 16, frozenset({0}))
    assert [n.costs for n in kept.nodes] == [n.costs for n in problem.nodes]
    assert [n.costs for n in reductions_weighed(problem, 1 / 16, frozenset({1})).nodes] == \
        [n.costs for n in reductions_weighed(problem, 1 / 16).nodes]  # no all-reduce over axis 1


def test_gradient_all_reduce_hides_behind_the_backward_and_the_flags_say_so():
    """Data-parallel MLP (batch >> hidden) on 8 A100s: the second layer's gradient all-reduce runs
    while the first layer's backward computes. Predicted faster than with overlap off, by the hidden
    time exactly; the plan carries the latency-hiding scheduler flags; on XLA:CPU nothing overlaps."""
    graph = zoo_graph("mlp-tiny", **{**TALL, "batch": 4 * TALL["batch"]})
    on = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20))
    off = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, overlap=False))
    assert on.input_specs == off.input_specs  # the same data-parallel plan
    p, q = on.prediction, off.prediction
    assert p.hidden_communication_time_s > 0 and q.hidden_communication_time_s == 0
    assert p.step_time_s < q.step_time_s
    assert p.step_time_s == pytest.approx(q.step_time_s - p.hidden_communication_time_s, rel=1e-9)
    assert p.communication_time_s + p.hidden_communication_time_s == pytest.approx(q.communication_time_s, rel=1e-9)
    assert on.solver.objective_s == pytest.approx(p.step_time_s, rel=1e-12)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in on.xla_flags() and off.xla_flags() == []
    back = type(on).from_json(on.to_json())
    assert back.xla_flags() == on.xla_flags()
    assert back.prediction.hidden_communication_time_s == p.hidden_communication_time_s
    cpu = make_plan(graph, MESH_8, PlanOptions(solver_time_limit=20, hardware="cpu"))
    assert cpu.prediction.hidden_communication_time_s == 0 and cpu.xla_flags() == []


def test_exposed_communication_is_the_fifo_backlog():
    """`hidden_time` against a hand schedule: compute c = (5, 1, 1) in program order, async
    collectives a = (0, 4, 3) issued after nodes 2 and 3. The stream runs 4 from t=6 to 10 and 3
    from 10 to 13; compute ends at 7: 6 exposed, 1 hidden."""
    from planner.ilp.objective import hidden_time

    @dataclasses.dataclass
    class N:
        ops: list
        costs: list
        comm_s: list
        async_s: list
        index: int

    nodes = [N([0], [5.0], [0.0], [0.0], 0), N([1], [5.0], [4.0], [4.0], 1), N([2], [4.0], [3.0], [3.0], 2)]

    @dataclasses.dataclass
    class P:  # the fields of `Problem` that `hidden_time` reads
        nodes: list
        overlap: bool = True
        prefetch: bool = False
        offloaded: tuple = ()

    assert hidden_time(P(nodes), [0, 0, 0]) == pytest.approx(1.0)
    assert hidden_time(P(nodes, overlap=False), [0, 0, 0]) == 0.0


def test_parameter_all_gathers_are_prefetched_behind_earlier_compute():
    """ZeRO-3 layout by pins: both weights stored split over 8 A100s, the batch-split matmuls read
    them whole, so each is all-gathered where it is read. The first gather has nothing to hide
    behind; the later ones are issued with it at the start of the step and hide behind the compute
    before their consumers when that is longer (a hand schedule on one link). The plan is predicted
    faster than with overlap off by exactly the hidden part; CP-SAT's objective, with the prefetch
    in max-plus form, is the same number."""
    from planner.ilp.objective import prefetch_hidden, prefetched, step_time
    from planner.ilp.solver import solve

    d, batch = 1024, 65536

    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    w = jax.ShapeDtypeStruct((d, d), jnp.bfloat16)
    graph = trace(step, w, w, jax.ShapeDtypeStruct((batch, d), jnp.bfloat16))
    zero3 = {0: ((0,), ()), 1: ((0,), ())}
    options = PlanOptions(solver_time_limit=20, hardware="a100", prefetch=True)
    on = make_plan(graph, MESH_8, options, pins=zero3)
    off = make_plan(graph, MESH_8, dataclasses.replace(options, overlap=False), pins=zero3)
    problem = build_problem(graph, cost_model_for(MESH_8, options), pins={graph.inputs[i]: s for i, s in zero3.items()})
    problem = dataclasses.replace(problem, prefetch=True)
    assert prefetch_hidden(dataclasses.replace(problem, prefetch=False), (0,) * len(problem.nodes)) == 0.0
    choice = solve(problem, None, 20.0).choice
    # The hand schedule: gathers (seconds) in order of their consumers, compute before each.
    gathers = sorted((problem.nodes[e.dst].ops[0], problem.edge_time(e.tensor, e.src_specs[choice[e.src]],
                                                                     e.dst_specs[choice[e.dst]]))
                     for e in problem.edges if prefetched(problem, e))
    gathers = [(k, g) for k, g in gathers if g > 0]
    weights = {e.tensor for e in problem.edges if prefetched(problem, e) and e.tensor in graph.inputs[:2]
               and problem.edge_time(e.tensor, e.src_specs[choice[e.src]], e.dst_specs[choice[e.dst]]) > 0}
    assert len(weights) == 2, "the plan reads both weights gathered"

    def compute_before(k):
        return sum(n.costs[choice[n.index]] - n.comm_s[choice[n.index]] for n in problem.nodes if n.ops and n.ops[0] < k)

    first = gathers[0][0]
    stall = sum(g for k, g in gathers if k == first)  # what the first consumer waits for
    assert compute_before(first) == 0
    assert all(sum(g for _, g in gathers[: j + 1]) - compute_before(k) <= stall for j, (k, _) in enumerate(gathers))
    assert stall < 0.5 * sum(g for _, g in gathers)
    total = sum(g for _, g in gathers)
    assert prefetch_hidden(problem, choice) == pytest.approx(total - stall, rel=1e-9)
    assert step_time(problem, choice).hidden_s >= total - stall
    p, q = on.prediction, off.prediction
    assert p.step_time_s < q.step_time_s
    assert p.step_time_s == pytest.approx(step_time(problem, choice).total_s, rel=1e-12)
    serial = step_time(dataclasses.replace(problem, overlap=False), choice)  # the same plan, nothing hidden
    assert serial.total_s - p.step_time_s == pytest.approx(p.hidden_communication_time_s, rel=1e-9)
    assert p.hidden_communication_time_s >= (total - stall) * (1 - 1e-9)
    objective, _, rounding = _cp_sat_optimum(problem)
    assert objective == pytest.approx(p.step_time_s, abs=rounding)
