"""The mesh search bounds each mesh before solving it: memory lower bounds skip meshes no plan fits,
step-time lower bounds skip meshes that cannot beat a plan found, and a budget nothing fits gets one
line with the bound, the smallest peak found and the levers."""
from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import pytest

from planner import cli
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.graph.trace import trace
from planner.ilp.objective import step_time
from planner.ilp.liveness import memory_profile
from planner.ilp.memory_bounds import liveness_floor, memory_floor, memory_lower_bound
from planner.core.options import PlanOptions
from planner.search.mesh_plan import plan_problem
from planner.core.mesh import MeshSpec
from planner.search.build import step_time_lower_bound
from planner.search.candidates import candidate_meshes
from planner.search.cores import spare_cores
from planner.search.meshes import search_meshes
from planner.search.refinement import _one_axis_away, coarsenings, keeps_together, neighbourhood, refined_choice
from planner.search.results import best_plan
from tests.helpers import zoo_graph
from zoo import get_model

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_search_pruning")


@pytest.fixture(scope="module")
def mlp_graph():
    return zoo_graph("mlp-tiny")


def test_step_time_bound_is_below_every_choice(mlp_graph):
    """Random choices (ties held or not) and the solved plan never go below the bound."""
    options = PlanOptions(hardware="v100")
    rng = random.Random(0)
    for mesh in candidate_meshes(8)[:2]:
        problem = plan_problem(mlp_graph, mesh, options)
        bound = step_time_lower_bound(problem)
        assert bound > 0
        for _ in range(50):
            choice = [0] * len(problem.nodes)
            for node in problem.nodes:
                choice[node.index] = rng.randrange(node.size) if node.size else 0
            choice = [choice[problem.rep[n]] for n in range(len(problem.nodes))]
            assert step_time(problem, choice).total_s >= bound * (1 - 1e-12)


def test_pruning_keeps_the_best_plan(mlp_graph):
    """With pruning the fastest plan is the one planning every mesh gives, same predicted time."""
    options = PlanOptions(hardware="v100")
    meshes = candidate_meshes(8)
    full = search_meshes(mlp_graph, meshes, options, prune=False)
    pruned = search_meshes(mlp_graph, meshes, options, prune=True, threads=1)
    assert best_plan(pruned) == best_plan(full)
    assert best_plan(pruned).prediction.step_time_s == best_plan(full).prediction.step_time_s
    for r in pruned:
        assert r.pruned is None or r.time_bound_s >= best_plan(full).prediction.step_time_s


def test_a_mesh_that_cannot_be_faster_is_not_solved():
    """An elementwise program needs no communication on any mesh: every mesh's bound equals the
    first plan's time, so the rest are pruned, and the answer is the unpruned search's."""
    def f(x):
        return jnp.tanh(x) * 2.0

    graph = trace(f, jax.ShapeDtypeStruct((64, 64), jnp.float32))
    options = PlanOptions(hardware="h100")
    meshes = candidate_meshes(8)
    results = search_meshes(graph, meshes, options, threads=1)
    solved = [r for r in results if r.plan is not None]
    assert len(solved) == 1 and any(r.pruned for r in results)
    assert best_plan(results) == best_plan(search_meshes(graph, meshes, options, prune=False))


def test_parallel_and_serial_searches_give_the_same_plans(mlp_graph):
    """Meshes solved by two threads at once: the same plans, same predictions, same ranking."""
    options = PlanOptions(hardware="v100")
    meshes = candidate_meshes(8)
    serial = search_meshes(mlp_graph, meshes, options, prune=False, threads=1)
    parallel = search_meshes(mlp_graph, meshes, options, prune=False, threads=2)
    assert [r.mesh for r in serial] == [r.mesh for r in parallel]
    assert [r.plan for r in serial] == [r.plan for r in parallel]
    assert best_plan(parallel) == best_plan(serial)


@pytest.mark.parametrize("cores, load, spare", [
    (2, 0.0, 2), (2, 1.0, 2),  # the load of the planner's own thread leaves both cores to it
    (2, 2.0, 1), (2, 6.0, 1),  # another job on one core (or more): one
    (8, 1.3, 8), (8, 3.0, 6), (1, 0.0, 1)])
def test_spare_cores_discount_the_callers_own_load(cores, load, spare):
    assert spare_cores(cores, load) == spare


@pytest.mark.parametrize("load, own, spare", [
    (1.9, 1.8, 2),  # the planner's own two solver threads: both cores still its own
    (3.0, 1.0, 1),  # another job on one core, the planner on the other: one
    (3.9, 1.9, 1)])
def test_spare_cores_discount_the_processs_own_threads(load, own, spare):
    assert spare_cores(2, load, own) == spare


def test_budget_under_every_bound_is_answered_without_solving(mlp_graph):
    """Every mesh's memory lower bound is over the budget: no mesh is solved, the minimum-peak
    search runs on the most promising mesh only, the answer is one line."""
    options = PlanOptions(hardware="v100", memory_budget=1000.0)
    results = search_meshes(mlp_graph, candidate_meshes(8), options)
    assert all(r.plan is None and r.over_budget for r in results)
    own = [r for r in results if r.same_as is None]
    assert all(r.lower_bound_bytes > 1000 for r in own)
    searched = [r for r in own if r.min_memory_bytes is not None]
    assert len(searched) == 1 and searched[0].mesh == candidate_meshes(8)[0]
    assert searched[0].min_memory_bytes >= searched[0].lower_bound_bytes
    with pytest.raises(InfeasiblePlanError) as e:
        best_plan(results, 1000.0)
    text = str(e.value)
    assert "\n" not in text and text.startswith("does not fit")
    assert e.value.lower_bound_bytes == min(r.lower_bound_bytes for r in own)
    assert e.value.min_memory_bytes == searched[0].min_memory_bytes
    for words in ("/device at best", "smallest peak found", "Tried: sharding", "rematerialisation", "host offload"):
        assert words in text
    for words in ("UNKNOWN", "status", "within its limit"):
        assert words not in text


def test_cli_budget_nothing_fits_is_one_line_exit_2(capsys):
    code = cli.main(["plan", "--model", "mlp-tiny", "--devices", "8", "--memory-budget", "1KB"])
    _, err = capsys.readouterr()
    assert code == 2
    last = [line for line in err.splitlines() if line.strip() and not line.startswith("[planner")]
    assert len(last) == 1 and "does not fit" in last[0] and "Traceback" not in err


def test_solver_limit_is_reported_as_undecided_not_as_does_not_fit():
    """A budget between the lower bound and the least peak, with a solver limit too short to decide:
    the mesh is undecided (not "does not fit"), the answer names the limit and no solver status."""
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return (x ** 2).sum()

    d = 64
    graph = trace(jax.grad(loss), [jax.ShapeDtypeStruct((d, d), jnp.float32)] * 3,
                  jax.ShapeDtypeStruct((64, d), jnp.float32))
    meshes = [candidate_meshes(8)[1]]
    free = search_meshes(graph, meshes, PlanOptions(hardware="h100"))[0]
    lower = memory_lower_bound(plan_problem(graph, meshes[0], PlanOptions(hardware="h100"))).max()
    budget = float(lower + 0.7 * (free.plan.prediction.memory_bytes_per_device - lower))
    options = PlanOptions(hardware="h100", memory_budget=budget, solver_time_limit=0.01)
    results = search_meshes(graph, meshes, options)
    assert results[0].plan is None and results[0].over_budget and results[0].error.proven is False
    with pytest.raises(InfeasiblePlanError) as e:
        best_plan(results, budget)
    text = str(e.value)
    assert not text.startswith("does not fit") and "not decided within the solver limit: 2x4" in text
    for words in ("UNKNOWN", "status", "found no plan within its limit"):
        assert words not in text


def test_memory_floor_is_below_every_mesh_bound(mlp_graph):
    """The bound known before any ILP is built (arguments and outputs split over every device) is
    below each mesh's `memory_lower_bound` where both count them: the end of the step."""
    for mesh in candidate_meshes(8):
        for hardware in ("v100", "cpu"):
            problem = plan_problem(mlp_graph, mesh, PlanOptions(hardware=hardware))
            end = len(mlp_graph.ops) + 1
            assert 0 < memory_floor(mlp_graph, 8) <= memory_lower_bound(problem)[end]


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_liveness_floor_is_below_every_mesh_bound_and_plan(model):
    """The floor one built mesh gives every mesh of its size (each live value split over every
    device) is below each mesh's `memory_lower_bound` and below the peak of random choices on
    it, donated or not, on a GPU preset and on XLA:CPU."""
    b = get_model(model)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    rng = random.Random(0)
    for donate in ((), (0,)):
        for hardware in ("h100", "cpu"):
            floors = set()
            for mesh in candidate_meshes(8):
                problem = plan_problem(graph, mesh, PlanOptions(hardware=hardware, donate_argnums=donate))
                floor = liveness_floor(problem)
                floors.add(floor)
                assert memory_floor(graph, 8, frozenset(graph.inputs[:len(graph.inputs)]) if donate else
                                    frozenset()) <= floor <= memory_lower_bound(problem).max()
                for _ in range(5):
                    choice = [rng.randrange(n.size) if n.size else 0 for n in problem.nodes]
                    assert floor <= memory_profile(problem, choice).max()
            assert len(floors) == 1  # the same on every mesh of the size: what lets one bound them all


def test_meshes_over_the_liveness_floor_are_not_built():
    """A budget under the liveness floor but over the arguments-and-outputs floor: the first mesh
    is built and bounded, the others of its size are over budget without an ILP, and say why."""
    b = get_model("gpt-tiny")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    problem = plan_problem(graph, candidate_meshes(8)[0], PlanOptions(hardware="v100"))
    live, ends = liveness_floor(problem), memory_floor(graph, 8)
    assert live > ends  # activations live mid-step on top of the arguments
    options = PlanOptions(hardware="v100", memory_budget=(live + ends) // 2)
    results = search_meshes(graph, candidate_meshes(8), options, threads=1)
    floored = [r for r in results if "live at the step's fullest point split over every device" in str(r.error)]
    first = candidate_meshes(8)[0]
    assert {r.mesh for r in floored} == set(candidate_meshes(8)) - {first}  # 4x2 as its twin 2x4
    assert all(r.plan is None for r in results) and all(r.over_budget for r in results if r.same_as is None)


def test_meshes_ruled_out_by_the_floor_name_donation_as_tried(mlp_graph):
    """A budget below the floor (no ILP built) still says which levers the floor counted: with the
    train state donated, donation is among those tried; without it, it is offered."""
    for donate in ((0,), ()):
        floor = memory_floor(mlp_graph, 8, frozenset(mlp_graph.inputs) if donate else frozenset())
        options = PlanOptions(hardware="v100", memory_budget=floor // 4, donate_argnums=donate)
        results = search_meshes(mlp_graph, candidate_meshes(8), options, threads=1)
        floored = [r for r in results if "split over every device" in str(r.error)]
        assert floored and all(any(v.name == "donating the train state" and (v.state == "tried") == bool(donate)
                                   for v in r.error.levers) for r in floored)
        with pytest.raises(InfeasiblePlanError) as e:
            best_plan(results)
        text = str(e.value)
        tried = text.split("Tried: ")[1].split(". ")[0]
        assert ("donating the train state" in tried) == bool(donate) and "\n" not in text
        assert donate or "donating the train state" in text.split("Other levers: ")[1]


def test_one_axis_neighbourhood_of_a_refined_spec():
    fine = MeshSpec((2, 2, 2), ("x", "y", "z"))
    near = _one_axis_away(((0,), (1, 2)), fine)  # batch over x, features over y*z
    assert ((0,), (1, 2)) in near  # the coarse spec itself
    assert ((0, 1), (2,)) in near and ((0, 2), (1,)) in near  # y or z moved to the batch
    assert ((0,), (2,)) in near and ((), (1, 2)) in near  # an axis taken out
    assert ((0, 1), (1, 2)) not in near and ((), (0, 1, 2)) in near  # moves keep each axis once
    assert all(len({a for d in s for a in d}) == sum(len(d) for d in s) for s in near)


def test_three_axis_meshes_are_searched_near_the_fastest_2d_plan():
    """mesh_ndim=3 adds 2x2x2, refining 2x4 (y of 2x4 becomes y, z: the same shardings on the same
    devices). It is searched after the 2-D meshes, near the 2x4 plan: an ILP over that plan's
    specs and those one axis away, solved from the plan itself, so never slower than it; when its
    answer is the 2x4 plan again the result says so instead of listing a second plan."""
    assert (2, 2, 2) not in [m.shape for m in candidate_meshes(8)]
    assert [m.shape for m in candidate_meshes(8, 3)][-1] == (2, 2, 2)
    assert coarsenings((2, 2, 2)) == [((4, 2), ((0, 1), (2,))), ((2, 4), ((0,), (1, 2)))]
    graph = zoo_graph("gpt-tiny")
    # One host: the 1-D mesh's plan is the fastest, so no 3-D mesh refines its mesh: none is searched.
    results = {r.mesh.shape: r for r in search_meshes(graph, candidate_meshes(8, 3), PlanOptions(hardware="a100"))}
    assert min((r for r in results.values() if r.plan), key=lambda r: r.plan.prediction.step_time_s).mesh.shape == (8,)
    assert "fastest plan so far (mesh 8)" in results[(2, 2, 2)].pruned and results[(2, 2, 2)].plan is None
    # Two hosts of four on 10 Gbit/s: 2x4 (hosts x devices) is the fastest, 2x2x2 refines it.
    options = PlanOptions(hardware="a100", inter_host="10Gbit")
    results = {r.mesh.shape: r for r in search_meshes(graph, candidate_meshes(8, 3), options, devices_per_host=4,
                                                          prune=False)}
    coarse = results[(2, 4)].plan
    assert coarse.prediction.step_time_s == min(r.plan.prediction.step_time_s for r in results.values() if r.plan)
    fine_result = results[(2, 2, 2)]
    fine = MeshSpec((2, 2, 2), ("x", "y", "z"))
    options = dataclasses.replace(options, inter_host_axes=(0,))
    allowed = neighbourhood(graph, coarse, ((0,), (1, 2)), fine)
    problem = plan_problem(graph, fine, options, allowed=allowed)
    for t in graph.inputs:  # the arguments take only specs near the coarse plan's
        assert set(problem.nodes[problem.owner[t]].owned[t]) <= allowed[t]
    assert sum(n.size for n in problem.nodes) < sum(n.size for n in plan_problem(graph, fine, options).nodes)
    start = refined_choice(problem, coarse, ((0,), (1, 2)))
    assert start is not None
    mapped = [tuple(tuple(f for a in dim for f in ((0,), (1, 2))[a]) for dim in spec) for spec in coarse.input_specs]
    assert [problem.spec(t, start) for t in graph.inputs] == mapped
    assert keeps_together(_as_plan(coarse, mapped), (1, 2))  # the 2x4 plan on 2x2x2
    split = [tuple(tuple(a for a in dim if a != 1) for dim in spec) for spec in mapped]  # y out, z kept
    assert mapped != split and not keeps_together(_as_plan(coarse, split), (1, 2))  # z alone: a 3-D layout
    if fine_result.plan is not None:  # a 3-D plan is listed only when it is faster and splits y, z somewhere
        assert fine_result.plan.prediction.step_time_s < coarse.prediction.step_time_s
        assert not keeps_together(fine_result.plan, (1, 2))
    else:
        assert "mesh 2x4" in fine_result.pruned, fine_result


def _as_plan(plan, input_specs):
    return dataclasses.replace(plan, input_specs=tuple(input_specs), op_specs=())


@pytest.mark.parametrize("bad", [0, 4, True, "3"])
def test_mesh_ndim_out_of_range_is_a_one_line_error(bad):
    with pytest.raises(InvalidArgumentError, match="mesh_ndim"):
        PlanOptions(mesh_ndim=bad)


def test_a_fitting_start_is_the_answer_when_the_limit_cuts_the_memory_rounds():
    """The unconstrained optimum is over the budget, the greedy start is under it: whatever the
    limit, the solver answers with a plan that fits (its own or the start), never "not decided"."""
    from planner.ilp.greedy import greedy
    from planner.ilp.liveness import memory_profile
    from planner.ilp.local_search import improve
    from planner.ilp.solver import solve

    graph = zoo_graph("gpt-tiny")
    problem = plan_problem(graph, MeshSpec((2, 4), ("x", "y")), PlanOptions(hardware="a100"))
    start_peak = memory_profile(problem, improve(problem, greedy(problem))).max()
    best = solve(problem)
    assert start_peak < best.peak_memory_bytes
    budget = (start_peak + best.peak_memory_bytes) / 2
    for limit in (1.8, 2.5):  # each cuts the second memory round (ortools 9.15)
        sol = solve(problem, budget, time_limit=limit)
        assert sol.peak_memory_bytes <= budget


def test_probe_bound_under_a_binding_budget_is_sound_and_orders_the_search():
    """Where the budget rules strategies out, a 1-unit CP-SAT probe bounds each 2-D mesh far above
    the per-op bound (GPT-39B on 8x8 V100 16 GB: 12.9 s vs 0.30 s for 8x8, 70.8-153.9 s for the other
    2-D meshes, whose solves the search then skips). gpt-tiny on 16 devices under a budget between
    the memory lower bound and the smallest unbudgeted peak: the probe is above the per-op bound and
    below the plan the solver finds, and the search keeps the raised bound of every such mesh."""
    from planner.ilp.memory_bounds import over_budget_strategies
    from planner.ilp.solver import probe_bound
    from planner.search.mesh_plan import make_plan

    b = get_model("gpt-tiny")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    meshes = [m for m in candidate_meshes(16) if len(m.shape) == 2]
    free = PlanOptions(hardware="v100", solver_time_limit=5.0)
    peak = min(make_plan(graph, m, free).prediction.memory_bytes_per_device for m in meshes[:2])
    lows = max(int(memory_lower_bound(plan_problem(graph, m, free)).max()) for m in meshes)
    budget = (lows + 3 * peak) / 4
    options = dataclasses.replace(free, memory_budget=budget)
    probes = {}
    for mesh in meshes:
        problem = plan_problem(graph, mesh, options)
        assert over_budget_strategies(problem, budget)  # the budget binds
        probes[mesh] = probe_bound(problem, budget)
        assert probes[mesh] > step_time_lower_bound(problem) * 1.1
    # a plan under the budget, as the solver finds one given time (10 units: the budget, three
    # quarters of the way up to the least peak, binds and still admits plans the solver finds soon)
    plan = make_plan(graph, MeshSpec((4, 4), ("x", "y")), dataclasses.replace(options, solver_time_limit=10.0))
    assert plan.prediction.step_time_s >= probes[MeshSpec((4, 4), ("x", "y"))] * (1 - 1e-9)
    results = search_meshes(graph, meshes, dataclasses.replace(options, solver_time_limit=1.0), threads=1)
    bounds = {r.mesh: r.time_bound_s for r in results if r.same_as is None}  # 8x2 mirrors 2x8
    assert len(bounds) == 2 and bounds == pytest.approx({m: probes[m] for m in bounds})


@pytest.mark.parametrize("hardware", ["h100", "cpu"])
def test_offload_liveness_floor_is_below_every_offload_choice(hardware):
    """With host offload the floor leaves out every value an offload choice may keep on the host:
    it is the same on every mesh of the size, below each mesh's memory lower bound with every such
    value on the host, and below the peak of random choices with any subset of them offloaded."""
    from planner.ilp.offload import bounding_problem, offloadable_pairs, with_offload

    b = get_model("llama-tiny")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    rng = random.Random(1)
    floors = set()
    for mesh in candidate_meshes(8):
        problem = plan_problem(graph, mesh, PlanOptions(hardware=hardware, offload="auto"))
        pairs = offloadable_pairs(problem, "auto")
        assert pairs and offloadable_pairs(problem, "off") == ()
        floor = liveness_floor(problem, {t for p in pairs for t in p if t >= 0})
        floors.add(floor)
        assert 0 < floor <= memory_lower_bound(bounding_problem(problem, "auto")).max()
        for _ in range(4):
            some = with_offload(problem, [p for p in pairs if rng.random() < 0.5])
            choice = [rng.randrange(n.size) if n.size else 0 for n in some.nodes]
            assert floor <= memory_profile(some, choice).max()
    assert len(floors) == 1


def test_offloaded_meshes_over_the_liveness_floor_are_not_built():
    """Under host offload a budget below that floor: the first mesh of the size is built and
    bounded, the others are over budget without an ILP, saying why, with host offload tried."""
    b = get_model("llama-tiny")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    first = candidate_meshes(8)[0]
    options = PlanOptions(hardware="h100", offload="auto")
    from planner.ilp.offload import offloadable_pairs
    problem = plan_problem(graph, first, options)
    live = liveness_floor(problem, {t for p in offloadable_pairs(problem, "auto") for t in p if t >= 0})
    results = search_meshes(graph, candidate_meshes(8), dataclasses.replace(options, memory_budget=live // 2),
                            threads=1)
    floored = [r for r in results if "every offloadable leaf on the host" in str(r.error)]
    assert {r.mesh for r in floored} == set(candidate_meshes(8)) - {first}
    assert all(any(v.name == "host offload" and v.state == "tried" for v in r.error.levers) for r in floored)
    assert all(r.plan is None for r in results)
