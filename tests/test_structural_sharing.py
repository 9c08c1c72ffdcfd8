"""Layer sharing by structure: repeated blocks without indexed module names (plain JAX,
a list of layer dicts, blocks wrapped in `jax.checkpoint`, any naming) share one set of decisions."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ortools.sat.python import cp_model

from planner.graph.trace import trace
from planner.ilp.objective import hidden_time
from planner.ilp.problem import build_problem
from planner.ilp.cpsat import _Model, plan_cost
from planner.ilp.ticks import _NS
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.search.mesh_plan import cost_model_for, make_plan

D, BATCH, SEQ, HEADS = 64, 8, 16, 4
MESH = MeshSpec((2, 4), ("x", "y"))


def _block(p, x):
    """Pre-norm attention and MLP: the repeated unit, as a user writes it in plain JAX."""
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    q, k, v = (jnp.einsum("bsd,de->bse", h, p[n]).reshape(BATCH, SEQ, HEADS, D // HEADS) for n in ("wq", "wk", "wv"))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // HEADS) ** 0.5, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(BATCH, SEQ, D) @ p["wo"]
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return x + jax.nn.gelu(h @ p["up"]) @ p["down"]


def _step(n_blocks: int):
    """A train step over `n_blocks` remat-wrapped blocks held in a list of dicts with arbitrary keys
    (no `name_<i>` module names anywhere), plain SGD."""
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "up": (D, 4 * D), "down": (4 * D, D)}
    params = {"layers": [{k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
                         for _ in range(n_blocks)],
              "head": jax.ShapeDtypeStruct((D, 32), jnp.float32)}
    x = jax.ShapeDtypeStruct((BATCH, SEQ, D), jnp.float32)
    block = jax.checkpoint(_block)

    def loss(params, x):
        for p in params["layers"]:
            x = block(p, x)
        return jnp.mean((x @ params["head"]) ** 2)

    def step(params, x):
        g = jax.grad(loss)(params, x)
        return jax.tree.map(lambda w, d: w - 0.1 * d, params, g)

    return trace(step, params, x)


def _problem(graph, share=True):
    return build_problem(graph, cost_model_for(MESH, PlanOptions()), share_layers=share)


def test_identical_blocks_share_one_set_of_decisions_whatever_the_depth():
    one, three, six = (_problem(_step(n)) for n in (1, 3, 6))
    distinct = len(set(three.rep))
    per_block = (len(six.nodes) - len(three.nodes)) // 3
    assert len(set(one.rep)) == len(one.nodes)  # nothing repeats in one block
    assert distinct == len(set(six.rep))  # depth adds no decision
    # one block's decisions plus the parts that do not repeat (the first block's backward computes no
    # gradient for the step's input, so its last nodes and some of its parameters stay apart)
    assert len(set(one.rep)) <= distinct < len(set(one.rep)) + per_block // 2
    for i, r in enumerate(six.rep):  # shared nodes play the same part: same ops, same strategies
        a, b = six.nodes[i], six.nodes[r]
        assert a.costs == b.costs and [six.graph.ops[o].name for o in a.ops] == [six.graph.ops[o].name for o in b.ops]


def test_structural_sharing_keeps_the_unshared_optimum():
    """On a 4-device mesh both solves are proven optimal in a few seconds: sharing loses nothing."""
    graph = _step(3)
    mesh = MeshSpec((4,), ("x",))
    start = time.perf_counter()
    shared = make_plan(graph, mesh, PlanOptions(solver_time_limit=30))
    elapsed = time.perf_counter() - start
    full = make_plan(graph, mesh, PlanOptions(solver_time_limit=30, share_layers=False))
    print(f"\nplanning 3 remat blocks at d={D} on 4 devices: {elapsed:.2f} s, {shared.solver.variables_shared} "
          f"distinct of {shared.solver.decisions} decisions")
    assert shared.solver.variables_shared < full.solver.variables_shared
    assert shared.solver.optimal and full.solver.optimal
    # each objective term is rounded to one 10 ps tick
    tolerance = full.solver.decisions / _NS
    assert shared.prediction.step_time_s == pytest.approx(full.prediction.step_time_s, abs=tolerance)


def test_overlap_in_closed_form_is_the_step_time_of_any_choice():
    """The exposed-communication model composes runs of repeated blocks in closed form; with every
    decision fixed (random choices), CP-SAT's objective is `step_time` of that choice, tick for tick."""
    problem = build_problem(_step(4), cost_model_for(MeshSpec((4,), ("x",)), PlanOptions()), tie_outputs=False)
    assert problem.overlap and any(a > 0 for n in problem.nodes for a in n.async_s)
    rng = np.random.default_rng(0)
    hidden = []
    for _ in range(3):
        choice = [0] * len(problem.nodes)
        for node in problem.nodes:
            r = problem.rep[node.index]
            choice[node.index] = choice[r] if r != node.index else int(rng.integers(node.size))
        model = _Model(problem)
        for vs, i in zip(model.x, choice):
            if not isinstance(vs[i], int):
                model.m.Add(vs[i] == 1)
        model.m.Minimize(model.objective)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        assert solver.Solve(model.m) == cp_model.OPTIMAL
        rounding = (model.rounded_terms + 1) / _NS  # each term is rounded to one 10 ps tick
        assert solver.ObjectiveValue() / _NS == pytest.approx(plan_cost(problem, choice), abs=rounding)
        hidden.append(hidden_time(problem, choice))
    assert max(hidden) > 0  # the overlap term is exercised, not zero throughout


def test_coordinate_descent_improves_the_greedy_hint():
    """Three remat-wrapped blocks on 2x4: the greedy plan is well above the optimum; coordinate
    descent (`local_search.improve`, the solver's hint and answer of last resort) lowers it, keeping ties."""
    from planner.ilp.greedy import _ties_hold, greedy
    from planner.ilp.local_search import improve

    problem = _problem(_step(3))
    start = greedy(problem)
    better = improve(problem, start)
    assert _ties_hold(problem, better)
    assert plan_cost(problem, better) < 0.9 * plan_cost(problem, start)
