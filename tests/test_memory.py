"""Memory: predicted peaks within 10% of XLA's compiled ones, budgets, impossible budgets."""
from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import planner
from tests.helpers import assert_bundle_step_close, concrete
from xla_hooks.inspect import memory_stats


def _data_parallel_peak(b, state, batch) -> int:
    """Per-device peak of hand-written data parallelism: state replicated, batch split 8 ways."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
    split = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("d")), batch)
    compiled = jax.jit(b.train_step, in_shardings=(rep, split)).lower(state, batch).compile()
    return memory_stats(compiled).peak_bytes


def test_budget_below_data_parallel_is_met_as_measured(devices8):
    b, state, batch = concrete("gpt-tiny")
    dp_peak = _data_parallel_peak(b, state, batch)
    budget = int(0.6 * dp_peak)
    # the levers off: what fitting the budget by sharding alone costs, and the levers named as not tried
    step = planner.plan_parallel(b.train_step, mesh="1x8", memory_budget=budget, remat="off", offload="off",
                                 accumulate=1, prefetch=False)
    plan = step.plan(state, batch)
    predicted = plan.prediction.memory_bytes_per_device
    assert predicted <= budget
    # The budget bound the solve: what it cost is recorded and printed with the levers not used.
    first = plan.solver.unbudgeted
    assert first.peak_bytes > budget and first.step_time_s <= plan.prediction.step_time_s * (1 + 1e-9)
    from planner.present.report import format_levers
    text = format_levers(plan)
    assert text.startswith("Memory budget: it binds.") and "--remat auto" in text
    assert ("ruled out" in text) == (first.strategies_ruled_out > 0) and "--donate 0" in text and "Levers not tried: " in text
    assert "\n" not in text
    measured = memory_stats(step.lower(state, batch).compile()).peak_bytes
    # The prediction within 10% of XLA's compiled peak, for this sharded plan too
    # (on XLA:CPU: its reduction buffers, `liveness._reduction_buffers`). The measured peak may then
    # exceed the budget by as much (the model leaves no headroom).
    assert 0.9 <= predicted / measured <= 1.1, f"predicted {predicted}, XLA peak {measured} (budget {budget})"
    assert measured < dp_peak
    # Still the same numbers as the unsharded step.
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_impossible_budget_names_the_reachable_minimum(devices8, monkeypatch):
    """The answer names the smallest peak of the step as the user compiles it; the check whether
    donating the train state would make a plan fit (`StepPlanner._donation_hint`) asks only whether
    one fits, so no smallest-peak search runs on the donated program."""
    from planner.ilp import infeasible

    searched = []
    real = infeasible._min_peak_search
    monkeypatch.setattr(infeasible, "_min_peak_search",
                        lambda problem, *a: searched.append(bool(problem.donated)) or real(problem, *a))
    b = concrete("gpt-tiny")[0]
    with pytest.raises(planner.InfeasiblePlanError, match=r"smallest per-device peak the planner could reach is") as e:
        planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh="1x8", memory_budget="100KB")
    assert e.value.min_memory_bytes is not None and e.value.min_memory_bytes > 100e3
    assert searched and not any(searched)


def _ratio(step, state, batch) -> float:
    predicted = step.plan(state, batch).prediction.memory_bytes_per_device
    return predicted / memory_stats(step.lower(state, batch).compile()).peak_bytes


def test_data_parallel_peak_within_ten_percent_of_compiled(devices8):
    """The predicted per-device peak is within 10% of XLA's compiled
    `memory_analysis()`: here a data-parallel plan of a transformer (gpt-tiny 2x4); the sharded
    plan a budget forces is checked in `test_budget_below_data_parallel_is_met_as_measured`."""
    b, state, batch = concrete("gpt-tiny")
    assert 0.9 <= _ratio(planner.plan_parallel(b.train_step, mesh="2x4"), state, batch) <= 1.1


def test_donated_state_is_written_over_as_compiled(devices8):
    """With the train state donated (`donate_argnums=0`), XLA writes the new state into the old
    state's buffers (its aliased bytes); the model frees each old leaf at its last use, so the
    predicted peak drops below the undonated plan's and stays within 10% of the compiled peak."""
    b, state, batch = concrete("gpt-tiny")
    kept = planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh="1x8")
    step = planner.plan_parallel(b.train_step, mesh="1x8", donate_argnums=0)
    predicted = step.plan(state, batch).prediction.memory_bytes_per_device
    compiled = memory_stats(step.lower(state, batch).compile())
    assert compiled.alias_bytes > 0
    assert 0.9 <= predicted / compiled.peak_bytes <= 1.1, f"predicted {predicted}, XLA peak {compiled.peak_bytes}"
    assert predicted < kept.prediction.memory_bytes_per_device
    with pytest.raises(planner.InvalidArgumentError, match="donate_argnums"):
        planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh="1x8", donate_argnums=(-1,))


@pytest.mark.parametrize("hardware", ["cpu", "h100-sxm"])
def test_ilp_memory_expression_equals_the_profile(hardware):
    """The ILP's budget constraints (`_Model.memory_expr`) count what `memory_profile` counts, at
    every point including XLA:CPU's extra one, and `memory_lower_bound` stays below both; under
    XLA:CPU's memory rules and XLA:GPU's (planned without devices, a GPU preset's: fused values take
    no memory, every operand copy only when resharded)."""
    import jax.numpy as jnp
    import numpy as np
    from ortools.sat.python import cp_model

    from planner.cost_model import CostModel
    from planner.graph.trace import trace
    from planner.ilp.problem import build_problem
    from planner.ilp.cpsat import _Model
    from planner.ilp.liveness import memory_profile
    from planner.ilp.memory_bounds import memory_lower_bound
    from planner.ilp.solver import solve
    from planner.core.mesh import MeshSpec

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return (x ** 2).sum()

    args = ([jnp.ones((64, 64))] * 2, jnp.ones((64, 64)))
    problem = build_problem(trace(jax.grad(loss), *args), CostModel.build(MeshSpec((2, 4), ("a", "b")), hardware),
                            share_layers=False)
    assert problem.memory_platform == ("cpu" if hardware == "cpu" else "gpu")
    differs = []
    for choice in (solve(problem).choice, solve(problem, memory_budget=solve(problem).peak_memory_bytes * 0.7).choice):
        profile = memory_profile(problem, choice)
        model = _Model(problem)
        exprs = [model.memory_expr(point, choice) for point in range(len(profile))]
        liveness = [model.memory_expr(point) for point in range(len(profile))]  # without the plan: a lower bound
        for node, i in enumerate(choice):
            for j, v in enumerate(model.x[node]):
                if not isinstance(v, int):
                    model.m.Add(v == int(i == j))
        copies = [z for z in model.copies.values() if not isinstance(z, int)]
        model.m.Minimize(sum(copies))  # a copy variable is only bounded below: at its least, it is the copy
        solver = cp_model.CpSolver()
        assert solver.Solve(model.m) == cp_model.OPTIMAL
        values = np.array([e if isinstance(e, int) else solver.Value(e) for e in exprs])
        assert (values == profile).all(), np.nonzero(values != profile)
        lower = np.array([e if isinstance(e, int) else solver.Value(e) for e in liveness])
        assert (lower <= profile).all()
        differs.append((lower < profile).any())
        assert (profile >= memory_lower_bound(problem)).all()
        assert (profile[-1] > 0) == (hardware == "cpu")  # XLA:CPU's accounting point is counted there only
    assert any(differs) == (hardware == "cpu")  # XLA:CPU's output buffers (`_borrowed`) count somewhere


def test_bf16_gradients_are_held_until_the_update():
    """A bf16 gradient of a float32 parameter is converted to float32 for the AdamW update; XLA
    fuses that convert into the update, which then reads the bf16 gradient. So the gradient stays
    in memory from the backward to the update (it once died at the convert, and the update's
    float32 copy, a fused value, was not counted either: nothing held it, 17.6 GB/device on a
    Llama-3-70B-shaped step on 1x8 H100)."""
    import jax.numpy as jnp
    import optax

    from planner.cost_model import CostModel
    from planner.graph.trace import trace
    from planner.ilp.problem import build_problem
    from planner.ilp.liveness import _materialised
    from planner.core.mesh import MeshSpec

    opt = optax.adamw(1e-3)

    def loss(params, x):
        for w in params.values():
            x = jnp.tanh(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))
        return (x.astype(jnp.float32) ** 2).mean()

    def step(params, opt_state, x):
        grads = jax.grad(loss)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w0": jnp.ones((64, 128)), "w1": jnp.ones((128, 64))}
    graph = trace(step, params, opt.init(params), jnp.ones((32, 64)))
    problem = build_problem(graph, CostModel.build(MeshSpec((1, 8), ("x", "y")), "h100-sxm"))
    moments = {t for t, path in zip(graph.inputs, graph.input_paths) if ".mu[" in path}
    first_update = min(op.index for op in graph.ops if any(isinstance(x, int) and x in moments for x in op.inputs))
    grads = [t for op in graph.ops if op.name == "dot_general" for t in op.outputs
             if graph.tensors[t].shape in ((64, 128), (128, 64)) and graph.tensors[t].dtype == jnp.bfloat16]
    assert len(grads) == 2
    for t in grads:
        first, last = problem.live[t]
        assert _materialised(problem, t, first) and last >= first_update, (graph.tensors[t], problem.live[t])


def test_gpu_values_kept_inside_a_fusion_take_no_memory():
    """XLA:GPU never writes a value made and used inside one fusion: in an attention-like step the
    float32 scores, exponentials and their gradients stay in registers, and what is in memory at
    the peak is the bfloat16 [n, n] values XLA writes (scores, probabilities, the backward product
    and its bf16 convert) and the small operands and row statistics. The compiled peaks of the
    zoo's models on an H100 were 1.46-2.13x over-predicted while such values counted, 1.02-1.13x
    without (experiments/results/gpu_check.md); counting them here gives 23 MB."""
    import jax.numpy as jnp
    import numpy as np

    from planner.cost_model import CostModel
    from planner.graph.trace import trace
    from planner.ilp.problem import build_problem
    from planner.ilp.liveness import memory_profile
    from planner.core.mesh import MeshSpec

    n, d = 1024, 256

    def f(q, k):
        s = (q @ k.T).astype(jnp.float32)
        return jnp.sum(jax.nn.softmax(s, axis=-1).astype(jnp.bfloat16) @ k)

    q = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    graph = trace(jax.grad(f, argnums=(0, 1)), q, q)
    problem = build_problem(graph, CostModel.build(MeshSpec((1,), ("x",)), "h100-sxm"))
    peak = int(np.max(memory_profile(problem, [0] * len(problem.nodes))))
    bf16_square = n * n * 2
    assert 4 * bf16_square <= peak <= 4 * bf16_square + 4 * n * d * 2 + 4 * n * 4


@pytest.mark.parametrize("split", [False, True])
def test_a_temporary_borrows_an_unwritten_output_only_where_it_fits(split):
    """XLA reserves each program output's buffer for the whole program and places a temporary in it
    before the output is written only when the temporary fits (`liveness._borrowed`). Here two 64 KiB
    temporaries (sin(x) and the matmul) are live together before any output is written: one 64 KiB
    output holds one of them (peak = argument + output + one temporary), sixteen 4 KiB slices hold
    neither (argument + outputs + both). The liveness count alone, which lets any temporary use any
    unwritten output's bytes, gives three 64 KiB buffers in both cases; XLA's compiled peak is the
    hand count, plus the output tuple's 8-byte pointer per output."""
    import jax.numpy as jnp

    from planner.cost_model import CostModel
    from planner.graph.trace import trace
    from planner.ilp.problem import build_problem
    from planner.ilp.cpsat import _Model
    from planner.ilp.liveness import memory_profile
    from planner.core.mesh import MeshSpec

    def f(x):
        t = jnp.sin(x) @ x
        return [t[:, 8 * k:8 * k + 8] * 2 for k in range(16)] if split else t * 2

    x = jnp.ones((128, 128))
    problem = build_problem(trace(f, x), CostModel.build(MeshSpec((1,), ("x",)), "cpu"))
    choice = [0] * len(problem.nodes)
    profile = memory_profile(problem, choice)
    buffer = 128 * 128 * 4
    assert profile.max() == (4 if split else 3) * buffer
    model = _Model(problem)  # the ILP's count without the plan: the liveness count (a lower bound)
    relaxed = max(model.memory_expr(p) for p in range(len(profile) - 1))  # one device: every term a constant
    assert relaxed == 3 * buffer
    compiled = memory_stats(jax.jit(f).lower(x).compile()).peak_bytes
    outputs = 16 if split else 1
    assert compiled - profile.max() in (0, 8 * outputs), (compiled, profile.max())


def test_a_scans_stacked_output_is_one_buffer_its_iterations_write():
    """An unrolled scan's stacked output lives from its first iteration's value on and the
    per-iteration values take no memory of their own (the scan writes each into its slice), so a
    layer's residuals are not counted twice at the stack."""
    from planner.graph.fusion import in_place_stacks
    from planner.ilp.live_ranges import live_ranges
    from tests.helpers import zoo_graph

    graph = zoo_graph("llama-tiny")  # its layers are one scan
    live = live_ranges(graph)
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    stacks = in_place_stacks(graph)
    assert stacks
    for i in stacks:
        op = graph.ops[i]
        parts = [x for x in op.inputs if isinstance(x, int) and x in producer]
        assert parts and all(live[x] == (-1, -2) for x in parts)
        assert live[op.outputs[0]][0] == min(producer[x] for x in parts)
