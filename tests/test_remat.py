"""Recomputation in single-stage plans (planner/levers/remat.py): the rewritten step computes the same
step, its plan compiles to less memory as predicted and shows the recomputation in its HLO, "auto"
recomputes only when the budget needs it, bad input is a one-line error."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner.emit.single import jit_planned
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.graph.trace import trace
from planner.core.mesh import parse_mesh
from planner.core.options import PlanOptions
from planner.core.plan_records import RematRecord
from planner.present.report import format_levers
from planner.search.mesh_plan import make_plan
from planner.levers.remat import WRAPPER, graph_for, rematerialize, remat_layers
from tests.helpers import (assert_gradients_close, assert_loss_close, assert_sgd_step_close, concrete,
                           longest_reduction, max_abs_diff)
from xla_hooks.inspect import memory_stats

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_remat")

# gpt-tiny with activations large enough that they, not the optimizer update, set the peak.
SHAPE = dict(layers=2, batch=16, seq=64)
# LLVM's optimisation level only: buffer assignment and the HLO passes are the same (so is the compiled
# peak), and compiling takes less time.
FAST = {"xla_backend_optimization_level": 0}


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST)(*args)


@pytest.fixture(scope="module")
def gpt():
    return concrete("gpt-tiny", **SHAPE)


@pytest.fixture(scope="module")
def planned(gpt):
    """remat -> (its plan, its compiled program) on 1x8."""
    b, state, batch = gpt
    out = {}
    for remat in ("off", "full"):
        step = planner.plan_parallel(b.train_step, mesh="1x8", remat=remat)
        out[remat] = (step.plan(state, batch), step.lower(state, batch).compile(FAST))
    return out


def _dots(compiled) -> int:
    return len(re.findall(r" dot\(", compiled.as_text()))


def _blocks_loss(params, x):
    """A plain-JAX stack of residual MLP blocks named blocks_0, blocks_1, ... (no flax)."""
    for i, (w1, w2) in enumerate(params):
        with jax.named_scope(f"blocks_{i}"):
            x = x + jnp.tanh(jax.nn.gelu(x @ w1) @ w2)
    return jnp.mean(x ** 2)


def _blocks_data(layers: int = 3, rows: int = 32):
    rng = np.random.default_rng(0)
    params = [(jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32),
               jnp.asarray(rng.normal(size=(64, 16)) / 8, jnp.float32)) for _ in range(layers)]
    return params, jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32)


def test_rewritten_graph_computes_the_same_gradients():
    """The rewritten graph, unsharded, against `jax.value_and_grad`."""
    params, x = _blocks_data()
    step = jax.value_and_grad(_blocks_loss)
    graph = trace(step, params, x)
    assert remat_layers(graph) == ["blocks_0", "blocks_1", "blocks_2"]
    want_loss, want_grads = _run(step, params, x)
    n = longest_reduction(step, params, x)
    for policy in ("full", "dots"):
        g = rematerialize(graph, None, policy)
        copies = [op for op in g.ops if op.name_stack.startswith(f"{WRAPPER}(")]
        assert len(g.ops) == len(graph.ops) + len(copies) and len(g.recompute) == 3
        assert [op.index for op in g.ops] == list(range(len(g.ops)))
        # "dots" keeps matmul results, "full" recomputes them too
        assert any(op.name == "dot_general" for op in copies) == (policy == "full")
        loss, grads = jax.tree_util.tree_unflatten(
            g.out_tree, _run(lambda *a, g=g: g.evaluate(list(a)), *jax.tree_util.tree_leaves((params, x))))
        assert_loss_close(loss, want_loss, n)
        assert_gradients_close(_blocks_loss, params, x, grads, want_grads, n)


def test_planned_remat_step_matches_the_unsharded_step(devices8):
    """Sharded, with "dots" ("full" is compiled below and shares the emission; both are checked
    unsharded above)."""
    params, x = _blocks_data()
    lr = 0.1

    def step(params, x):
        return jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(_blocks_loss)(params, x))

    planned = planner.plan_parallel(step, mesh="2x4", remat="dots")
    plan = planned.plan(params, x)
    assert plan.levers.remat.layers == ("blocks_0", "blocks_1", "blocks_2")
    new_params = planned(params, x)
    assert_sgd_step_close(_blocks_loss, lr, params, x, new_params)
    # A saved plan is emitted on the graph it was made for, rewritten from a fresh trace.
    loaded = planner.Plan.from_json(plan.to_json()).bind(params, x, mesh=plan.jax_mesh, out_tree=plan.out_tree)
    fresh = trace(step, params, x)
    with pytest.raises(InvalidArgumentError):
        jit_planned(fresh, loaded)
    with jax.sharding.set_mesh(loaded._mesh()):
        again = jit_planned(graph_for(fresh, loaded), loaded)(*jax.device_put((params, x), loaded.in_shardings))
    assert max_abs_diff(again, new_params) == 0.0  # the same program


def test_remat_plan_compiles_to_less_memory_as_predicted(planned, devices8):
    (off, off_compiled), (full, full_compiled) = planned["off"], planned["full"]
    assert full.levers.remat.layers == ("blocks_0", "blocks_1")
    measured = {k: memory_stats(c).peak_bytes for k, (_, c) in planned.items()}
    for k, (plan, _) in planned.items():  # within 10% of the compiled peak, as tests/test_memory.py asserts
        assert 0.9 <= plan.prediction.memory_bytes_per_device / measured[k] <= 1.1, (k, plan.prediction, measured)
    assert measured["full"] < 0.9 * measured["off"], measured
    assert full.prediction.memory_bytes_per_device < 0.9 * off.prediction.memory_bytes_per_device
    assert _dots(full_compiled) > _dots(off_compiled)  # the recomputation is in the compiled program
    assert full.prediction.compute_time_s > off.prediction.compute_time_s  # and priced


def test_auto_recomputes_only_when_the_budget_needs_it(gpt, planned, devices8):
    b, state, batch = gpt
    off, full = planned["off"][0], planned["full"][0]
    roomy = planner.plan(b.train_step, state, batch, mesh="1x8", remat="auto",
                         memory_budget=int(1.05 * off.prediction.memory_bytes_per_device))
    assert roomy.levers.remat == RematRecord("off") and roomy.prediction == off.prediction
    budget = int(1.02 * full.prediction.memory_bytes_per_device)
    assert budget < off.prediction.memory_bytes_per_device
    tight = planner.plan(b.train_step, state, batch, mesh="1x8", remat="auto", memory_budget=budget)
    assert tight.prediction.memory_bytes_per_device <= budget
    # the fastest that fits: full recomputation's unconstrained plan fits this budget, so nothing slower
    assert tight.prediction.step_time_s <= full.prediction.step_time_s
    # what recomputation bought: the plan without it, weighed and printed beside the chosen one
    rec = tight.levers.remat
    assert rec.layers and rec.without_fits is not None
    if rec.without_fits:  # it fits only with more sharding: slower than the plan chosen
        assert rec.without_step_time_s > tight.prediction.step_time_s and rec.without_memory_bytes <= budget
    else:
        assert rec.without_step_time_s is None and (rec.without_memory_bytes or budget + 1) > budget
    assert "without it" in format_levers(tight) and "\n" not in format_levers(tight).split("\n\n")[-1]
    assert planner.Plan.from_json(tight.to_json()).levers.remat == rec


LR = 0.1


def _sgd_step(params, x):
    return jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(_blocks_loss)(params, x))


@pytest.fixture(scope="module")
def partial():
    """Six MLP blocks on 2x4, activations (512 rows) setting the peak, planned by remat="auto" under
    a budget of the unconstrained peak with "dots" on the first 3 layers, below the peak without
    recomputation: (params, x, budget, the PlannedFunction, its plan)."""
    params, x = _blocks_data(layers=6, rows=512)
    graph = trace(_sgd_step, params, x)
    spec, _ = parse_mesh("2x4")  # planned as plan_parallel plans it: on that mesh of the devices
    first3 = rematerialize(graph, remat_layers(graph)[:3], "dots")
    budget = make_plan(first3, spec, PlanOptions(), spec.to_jax_mesh(jax.devices()[:8])).prediction
    budget = budget.memory_bytes_per_device
    planned = planner.plan_parallel(_sgd_step, mesh="2x4", remat="auto", memory_budget=budget)
    return params, x, budget, planned, planned.plan(params, x)


def test_auto_recomputes_the_fewest_first_layers_that_fit(devices8, partial):
    """Under a budget only some layers' recomputation meets, "auto" recomputes the first n < L
    layers; its plan fits, and the same policy on the first n - 1 layers, planned the same way (no
    smallest-peak search), does not."""
    params, x, budget, _, plan = partial
    record = plan.levers.remat
    graph = trace(_sgd_step, params, x)
    layers = remat_layers(graph)
    n = len(record.layers)
    assert record.policy in ("dots", "full") and record.recomputable == len(layers) == 6
    assert 1 <= n < len(layers) and record.layers == tuple(layers[:n]), record
    assert plan.prediction.memory_bytes_per_device <= budget
    spec, _ = parse_mesh("2x4")  # planned as plan_parallel plans it: on that mesh of the devices
    jax_mesh, options = spec.to_jax_mesh(devices8), PlanOptions(remat="auto", memory_budget=budget)
    with pytest.raises(InfeasiblePlanError):
        make_plan(rematerialize(graph, layers[:n - 1], record.policy), spec, options, jax_mesh,
                  min_peak_search=False)


def test_partial_remat_plan_matches_the_unsharded_step_and_re_emits(devices8, partial):
    params, x, _, planned, plan = partial
    assert 0 < len(plan.levers.remat.layers) < plan.levers.remat.recomputable
    new_params = planned(params, x)
    assert_sgd_step_close(_blocks_loss, LR, params, x, new_params)
    # the saved plan names the layers; a fresh trace rewritten from it emits the same program
    loaded = planner.Plan.from_json(plan.to_json()).bind(params, x, mesh=plan.jax_mesh, out_tree=plan.out_tree)
    assert loaded.levers.remat == plan.levers.remat
    fresh = trace(_sgd_step, params, x)
    assert len(graph_for(fresh, loaded).ops) == len(planned.graph(params, x).ops)
    with jax.sharding.set_mesh(loaded._mesh()):
        again = jit_planned(graph_for(fresh, loaded), loaded)(*jax.device_put((params, x), loaded.in_shardings))
    assert max_abs_diff(again, new_params) == 0.0  # the same program


def test_bad_input_is_one_line():
    graph = trace(jax.value_and_grad(_blocks_loss), *_blocks_data())
    for call in (lambda: rematerialize(graph, None, "some"),
                 lambda: rematerialize(graph, ["blocks_7"]),
                 lambda: planner.PlanOptions(remat="yes"),
                 lambda: planner.PlanOptions(remat="full", pipeline="auto"),
                 lambda: planner.plan(lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w),
                                      jnp.ones((8, 8)), jnp.ones((8, 8)), mesh="1x8", remat="full")):
        with pytest.raises(InvalidArgumentError) as e:
            call()
        assert "\n" not in str(e.value)


def test_auto_says_when_it_has_no_layer_to_recompute():
    """remat='auto' on a step with no layer it can rewrite (here: one layer, neither repeated nor
    scanned) does not leave a budget no plan fits looking as if recomputation had not been asked for."""
    def loss(ws, x):
        return jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]).sum()

    ws, x = jnp.ones((2, 64, 64)), jnp.ones((32, 64))
    with pytest.raises(InfeasiblePlanError) as e:
        planner.plan(jax.value_and_grad(loss), ws, x, mesh="1x8", remat="auto", memory_budget="1KB")
    assert "remat='auto' found no layer it can recompute" in str(e.value) and "\n" not in str(e.value)


def _searched(g, spec, options, smallest, beat):
    """`plan_remat`'s plan_fn over one mesh: its search's results, InfeasiblePlanError when no plan."""
    from planner.search.meshes import search_meshes

    results = search_meshes(g, [spec], options, min_peak_search=smallest, beat=beat)
    if results[0].plan is None:
        raise InfeasiblePlanError("no plan", None)
    return results


def test_auto_bounds_each_policy_by_the_fastest_that_fits(devices8):
    """remat="auto" solves a policy only for a plan that beats the fastest fitting one so far (the
    mesh search's `beat`); the answer is the one solving every policy to the end gives."""
    import math

    from planner.levers.remat import plan_remat

    params, x = _blocks_data(layers=6, rows=512)
    graph = trace(_sgd_step, params, x)
    spec, _ = parse_mesh("2x4")
    plain = make_plan(graph, spec, PlanOptions()).prediction.memory_bytes_per_device
    options = PlanOptions(memory_budget=0.8 * plain)
    beats = []

    def plan_fn(g, smallest, beat=math.inf, honour=True):
        beats.append(beat)
        return _searched(g, spec, options, smallest, beat if honour else math.inf)

    def of(results):
        return results[0].plan

    _, bounded, policy, _ = plan_remat(graph, "auto", options.memory_budget, plan_fn, of)
    assert any(math.isfinite(b) for b in beats), beats  # a policy after the first that fit was bounded
    _, full, policy_full, _ = plan_remat(graph, "auto", options.memory_budget,
                                         lambda g, s, beat=math.inf: plan_fn(g, s, beat, honour=False), of)
    assert policy == policy_full
    assert of(bounded).prediction.step_time_s == pytest.approx(of(full).prediction.step_time_s, rel=1e-9)


def test_policies_probed_side_by_side_give_the_plan_probed_in_turn(devices8):
    """remat="auto" with `threads=2` probes the policies on two threads at once (gradient
    accumulation's one-mesh search, whose solves leave cores idle) and chooses what probing them
    one after another chooses: the same policy and the same plan."""
    import math
    import threading

    from planner.levers.remat import plan_remat

    params, x = _blocks_data(layers=6, rows=512)
    graph = trace(_sgd_step, params, x)
    spec, _ = parse_mesh("2x4")
    plain = make_plan(graph, spec, PlanOptions()).prediction.memory_bytes_per_device
    options = PlanOptions(memory_budget=0.8 * plain)
    calls, threads = [], set()
    meet = threading.Barrier(2, timeout=30)  # the first two policies' probes wait for each other

    def plan_fn(g, smallest, beat=math.inf, side=False):
        calls.append(g)
        if side and len(calls) in (2, 3):  # after "off": dots and dots_no_batch
            threads.add(threading.get_ident())
            meet.wait()  # raises BrokenBarrierError when the other never comes (probed in turn)
        return _searched(g, spec, options, smallest, beat)

    def of(results):
        return results[0].plan

    _, in_turn, policy, _ = plan_remat(graph, "auto", options.memory_budget, plan_fn, of, threads=1)
    assert len(calls) >= 4  # off and the three policies
    calls.clear()
    _, side, policy_side, _ = plan_remat(graph, "auto", options.memory_budget,
                                         lambda g, s, beat=math.inf: plan_fn(g, s, beat, side=True), of, threads=2)
    assert len(threads) == 2  # two policies were planned at once, on two threads
    assert policy_side == policy != "off"
    assert of(side).prediction.step_time_s == of(in_turn).prediction.step_time_s
    assert of(side).input_specs == of(in_turn).input_specs


def test_accumulated_microbatch_policies_are_bounded_too(devices8):
    """Gradient accumulation plans each microbatch step with remat="auto": there too a policy after
    the first that fits is searched with that plan's step time to beat, through every wrapper of the
    composition's search (`_accumulated`'s recording one included)."""
    import math

    import optax

    from planner.core.mesh import MeshSpec
    from planner.planning.composition import compose
    from planner.search.meshes import search_meshes

    step = planner.pipelinable(_blocks_loss, optax.sgd(LR))
    params, x = _blocks_data(layers=6, rows=512)
    state = {"params": params, "opt_state": optax.sgd(LR).init(params)}
    graph = trace(step, state, x)
    spec, _ = parse_mesh("2x4")
    beats = []

    def search(g, o, smallest, only=None, beat=math.inf):
        beats.append(beat)
        return search_meshes(g, [spec], o, min_peak_search=smallest, beat=beat)

    # the 256-row microbatch step needs 233 kB on 2x4 without recomputation, 152 kB with "dots"
    budget = 200e3
    options = PlanOptions(memory_budget=budget, accumulate=2, remat="auto", donate_argnums=(0,))
    plan = compose(step, graph, options, search, MeshSpec((8,), ("x",))).plan
    assert plan.levers.accumulation.microbatches == 2 and plan.levers.remat.policy != "off"
    assert plan.prediction.memory_bytes_per_device <= budget
    assert any(math.isfinite(b) for b in beats), beats


def test_the_fewest_layers_bisection_ends_where_a_probe_cannot_beat_the_fastest_plan():
    """remat="auto"'s first-n-layers bisection gives each probe the fastest step time found and
    stops at a probe no mesh of which can beat it (`NotFasterError`): fewer layers hold more memory."""
    import math
    import types

    from planner.core.errors import NotFasterError
    from planner.levers.remat import plan_remat

    params, x = _blocks_data(layers=6, rows=64)
    graph = trace(_sgd_step, params, x)
    beats = []

    def plan_fn(g, smallest, beat=math.inf):
        beats.append(beat)
        if len(beats) == 1:  # "off"
            raise InfeasiblePlanError("no plan fits", None)
        if math.isfinite(beat):  # every later probe: the fastest plan so far is out of its reach
            raise NotFasterError("no plan beats the step time to beat")
        return types.SimpleNamespace(prediction=types.SimpleNamespace(step_time_s=1.0 + 0.1 * len(beats)))

    _, result, policy, _ = plan_remat(graph, "auto", 1e9, plan_fn, lambda r: r)
    assert policy == "dots" and result.prediction.step_time_s == pytest.approx(1.2)
    # off, dots (fits), dots_no_batch and full (bounded: cannot beat), one bisection probe (bounded), stop
    assert beats[:2] == [math.inf, math.inf] and beats[2:] == [pytest.approx(1.2)] * 3, beats


def _projections_loss(params, x):
    """Blocks of two projections with no nonlinearity between: a block's residuals are matmul
    outputs (and its input), so "dots" and "dots_no_batch" leave the step as it is; "full" does not."""
    for i, (w1, w2) in enumerate(params):
        with jax.named_scope(f"blocks_{i}"):
            x = x + (x @ w1) @ w2
    return jnp.mean(x ** 2)


def test_auto_probes_full_where_the_dot_policies_change_nothing(devices8):
    """remat="auto" probes every policy that rewrites the step, not only those before the first that
    does not: here "full" is probed and bisected to the fewest first layers that fit, like any fitting
    policy, not reached through the all-layers fallback (`_fully_recomputed`)."""
    import math

    from planner.levers.remat import plan_remat, summary

    params, x = _blocks_data(layers=6, rows=512)

    def step(p, x):
        return jax.tree.map(lambda a, g: a - LR * g, p, jax.grad(_projections_loss)(p, x))

    graph = trace(step, params, x)
    assert rematerialize(graph, None, "dots") is graph and rematerialize(graph, None, "full") is not graph
    spec, _ = parse_mesh("2x4")
    names = remat_layers(graph)
    # below what every block recomputed needs without more sharding: the plan shards more, and
    # recomputing fewer blocks leaves room for that
    budget = 0.93 * make_plan(rematerialize(graph, None, "full"), spec, PlanOptions()).prediction.memory_bytes_per_device
    options = PlanOptions(memory_budget=budget)

    def plan_fn(g, smallest, beat=math.inf):
        return _searched(g, spec, options, smallest, beat)

    planned, results, policy, _ = plan_remat(graph, "auto", budget, plan_fn, lambda r: r[0].plan)
    assert policy == "full" and results[0].plan.prediction.memory_bytes_per_device <= budget
    assert 0 < len(summary(graph, planned, policy).layers) < len(names)
