"""Recomputation of a scanned stack of layers (planner/graph/scan_remat.py): the rewritten step
computes the same step, its forward scan stacks each layer's input instead of the residuals, the
plan compiles to less memory, remat="auto" uses it when the budget needs it, and a saved plan is
emitted again on its graph."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner.core.errors import InfeasiblePlanError
from planner.emit.single import jit_planned
from planner.graph.scan_remat import is_recomputed, recomputable_scans, recompute_scans, scan_pairs, split_length
from planner.graph.trace import trace
from planner.levers.remat import graph_for
from planner.present.report import format_levers
from tests.helpers import (assert_bundle_step_close, assert_gradients_close, assert_loss_close, concrete,
                           longest_reduction, max_abs_diff)
from xla_hooks.inspect import memory_stats

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_scan_remat")

FAST = {"xla_backend_optimization_level": 0}  # as tests/test_remat.py: the same buffers, faster to compile


def _scanned_loss(params, x):
    """A plain-JAX stack of residual MLP blocks scanned over stacked weights (no checkpoint)."""
    w1, w2 = params

    def layer(h, w):
        a, b = w
        return h + jnp.tanh(jax.nn.gelu(h @ a) @ b), None

    return jnp.mean(jax.lax.scan(layer, x, (w1, w2))[0] ** 2)


def _data(layers: int = 4, rows: int = 64, width: int = 16, hidden: int = 128):
    rng = np.random.default_rng(0)
    params = (jnp.asarray(rng.normal(size=(layers, width, hidden)) / 4, jnp.float32),
              jnp.asarray(rng.normal(size=(layers, hidden, width)) / 8, jnp.float32))
    return params, jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)


def _forward_scan_bytes(graph) -> int:
    """Bytes of the stacked outputs of the step's first (forward) scan region."""
    region = min((r for rs in graph.regions.values() for r in rs if r.kind == "scan"), key=lambda r: r.start)
    return sum(graph.tensors[t].nbytes for t in region.outputs if isinstance(t, int))


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_rewritten_scan_computes_the_same_gradients(policy):
    """Unsharded, against `jax.value_and_grad` of the scanned loss: the same primitives on the same
    operands, so the tolerance is the reduction's (`longest_reduction`)."""
    params, x = _data()
    step = jax.value_and_grad(_scanned_loss)
    graph = trace(step, params, x)
    assert recomputable_scans(graph) == 1 and len(scan_pairs(graph.source.jaxpr.jaxpr)) == 1
    g = recompute_scans(graph, policy)
    assert g is not graph and g.source.scans_recomputed == 1
    assert recomputable_scans(g) == 0  # rewritten once only
    # the forward scan now stacks less: the layer inputs (and under "dots" the matmul results)
    assert _forward_scan_bytes(g) < _forward_scan_bytes(graph)
    if policy == "full":
        # the final carry and one [rows, width] float32 input per layer
        assert _forward_scan_bytes(g) == (1 + 4) * 64 * 16 * 4
    recomputed = [op for op in g.ops if is_recomputed(op.name_stack)]
    assert recomputed and all(op.name_stack.startswith("transpose(") for op in recomputed)
    assert any(op.name == "dot_general" for op in recomputed) == (policy == "full")
    want_loss, want_grads = jax.jit(step)(params, x)
    loss, grads = jax.tree_util.tree_unflatten(
        g.out_tree, jax.jit(lambda *a: g.evaluate(list(a)))(*jax.tree_util.tree_leaves((params, x))))
    n = longest_reduction(step, params, x)
    assert_loss_close(loss, want_loss, n)
    assert_gradients_close(_scanned_loss, params, x, grads, want_grads, n)


def test_the_first_layers_of_a_scanned_stack_recompute_and_compute_the_same_gradients():
    """`first=n`: the forward scan splits at n (its first n iterations stack their inputs, the others
    their residuals) and so does the backward; the same primitives on the same operands, so the
    tolerance is the reduction's. n outside 1..L-1 is no such rewrite."""
    params, x = _data()
    step = jax.value_and_grad(_scanned_loss)
    graph = trace(step, params, x)
    assert split_length(graph) == 4
    whole, off = recompute_scans(graph, "full"), _forward_scan_bytes(graph)
    assert recompute_scans(graph, "full", first=0) is graph and recompute_scans(graph, "full", first=4) is graph
    want_loss, want_grads = jax.jit(step)(params, x)
    n = longest_reduction(step, params, x)
    stacked = []
    for first in (1, 2, 3):
        g = recompute_scans(graph, "full", first=first)
        assert g.source.scans_recomputed == 1 and g.source.scan_first == first and recomputable_scans(g) == 0
        scans = sorted((r for rs in g.regions.values() for r in rs if r.kind == "scan"), key=lambda r: r.start)
        assert len(scans) == 4  # the forward's two parts, then the backward's two
        stacked.append(sum(g.tensors[t].nbytes for r in scans[:2] for t in r.outputs if isinstance(t, int)))
        assert any(is_recomputed(op.name_stack) for op in g.ops)
        loss, grads = jax.tree_util.tree_unflatten(
            g.out_tree, jax.jit(lambda *a: g.evaluate(list(a)))(*jax.tree_util.tree_leaves((params, x))))
        assert_loss_close(loss, want_loss, n)
        assert_gradients_close(_scanned_loss, params, x, grads, want_grads, n)
    # each recomputed layer stacks its input instead of its residuals: fewer bytes with more layers
    assert _forward_scan_bytes(whole) < stacked[2] < stacked[1] < stacked[0] < off


def test_a_transformed_graph_is_not_rewritten_again():
    params, x = _data()
    graph = trace(jax.value_and_grad(_scanned_loss), params, x)
    changed = dataclasses.replace(graph, ops=graph.ops[:1] + graph.ops[1:])  # a transformation makes new ops
    assert recomputable_scans(changed) == 0 and recompute_scans(changed, "full") is changed


@pytest.fixture(scope="module")
def llama():
    """llama-tiny (layers scanned over stacked weights, no checkpoint of its own), big enough that
    activations, not the parameters, set the peak."""
    return concrete("llama-tiny", batch=16, seq=64)


def test_planned_scanned_remat_matches_the_unsharded_step_and_compiles_smaller(llama, devices8):
    b, state, batch = llama
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    compiled, plans = {}, {}
    for remat in ("off", "full"):
        step = planner.plan_parallel(b.train_step, mesh="2x4", remat=remat)
        plans[remat] = step.plan(state, batch)
        compiled[remat] = step.lower(state, batch).compile(FAST)
        if remat == "full":
            new_state, metrics = step(state, batch)
            assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    assert plans["full"].levers.remat.scans == 1 and plans["full"].levers.remat.recomputed_ops > 0
    measured = {k: memory_stats(c).peak_bytes for k, c in compiled.items()}
    assert measured["full"] < measured["off"], measured
    assert plans["full"].prediction.memory_bytes_per_device < plans["off"].prediction.memory_bytes_per_device
    assert plans["full"].prediction.compute_time_s > plans["off"].prediction.compute_time_s  # priced
    assert "1 scanned stack(s) of layers recomputed" in format_levers(plans["full"])

    # a saved plan is emitted on the graph it was made for, rewritten from a fresh trace
    plan = plans["full"]
    loaded = planner.Plan.from_json(plan.to_json()).bind(state, batch, mesh=plan.jax_mesh, out_tree=plan.out_tree)
    assert loaded.levers.remat.scans == 1
    fresh = trace(b.train_step, state, batch)
    with pytest.raises(planner.InvalidArgumentError):
        jit_planned(fresh, loaded)
    with jax.sharding.set_mesh(loaded._mesh()):
        again = jit_planned(graph_for(fresh, loaded), loaded)(*jax.device_put((state, batch), loaded.in_shardings))
    assert max_abs_diff(again, (new_state, metrics)) == 0.0  # the same program


def test_auto_recomputes_a_scanned_stack_when_the_budget_needs_it(llama, devices8):
    b, state, batch = llama
    off = planner.plan(b.train_step, state, batch, mesh="1x8")
    assert planner.plan(b.train_step, state, batch, mesh="1x8", remat="auto",
                        memory_budget=2 * off.prediction.memory_bytes_per_device).levers.remat.policy == "off"
    with pytest.raises(InfeasiblePlanError) as e:
        planner.plan(b.train_step, state, batch, mesh="1x8", memory_budget="1KB", remat="off", offload="off",
                     accumulate=1)
    budget = int(0.95 * e.value.lower_bound_bytes)  # below what any plan without recomputation can reach
    # recomputation alone (offload and accumulation, also default levers, are tested on their own)
    tight = planner.plan(b.train_step, state, batch, mesh="1x8", remat="auto", memory_budget=budget, offload="off",
                         accumulate=1)
    rec = tight.levers.remat
    assert rec.policy != "off" and rec.scans == 1 and rec.without_fits is False
    assert tight.prediction.memory_bytes_per_device <= budget


def _linear_loss(params, x):
    """A scanned stack whose only residual is each layer's hidden activation (h @ a): "dots" keeps
    it, so only "full" saves memory, at the price of recomputing a matmul per layer."""
    w1, w2 = params
    return jnp.mean(jax.lax.scan(lambda h, w: (h + (h @ w[0]) @ w[1], None), x, (w1, w2))[0] ** 2)


def _linear_step(params, x):
    loss, grads = jax.value_and_grad(_linear_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss, grads


def test_auto_recomputes_the_first_layers_of_a_scanned_stack_where_that_is_fastest(devices8):
    """Under a budget no plan without recomputation meets, "full" on the first n of 8 scanned layers
    fits and is faster than on all 8 (less recomputed): remat="auto" chooses it (`split_length`
    bisection, `levers.remat`), the plan says so, runs against the unsharded step within the
    summation-order bounds, compiles below the plan without recomputation, and a saved plan is
    emitted again on the graph it was made for."""
    rng = np.random.default_rng(0)
    params = (jnp.asarray(rng.normal(size=(8, 16, 256)) / 16, jnp.float32),
              jnp.asarray(rng.normal(size=(8, 256, 16)) / 64, jnp.float32))
    x = jnp.asarray(rng.normal(size=(8192, 16)), jnp.float32)  # many rows: the recomputed matmuls dominate
    common = dict(mesh="8", offload="off", accumulate=1)
    with pytest.raises(InfeasiblePlanError) as e:
        planner.plan(_linear_step, params, x, memory_budget="1KB", remat="off", **common)
    budget = int(0.8 * e.value.lower_bound_bytes)
    step = planner.plan_parallel(_linear_step, remat="auto", memory_budget=budget, **common)
    plan = step.plan(params, x)
    rec = plan.levers.remat
    assert rec.policy == "full" and rec.scans == 1 and 0 < rec.scan_layers < 8, rec
    assert plan.prediction.memory_bytes_per_device <= budget
    every = planner.plan(_linear_step, params, x, remat="full", memory_budget=budget, **common)
    assert every.levers.remat.scan_layers is None
    assert plan.prediction.step_time_s < every.prediction.step_time_s
    assert f"the first {rec.scan_layers} layers of each" in format_levers(plan)

    new_params, loss, grads = step(params, x)
    want_params, want_loss, want_grads = jax.jit(_linear_step)(params, x)
    n = longest_reduction(_linear_step, params, x)
    assert_loss_close(loss, want_loss, n)
    assert_gradients_close(_linear_loss, params, x, grads, want_grads, n)

    off = planner.plan_parallel(_linear_step, mesh="8", remat="off", offload="off", accumulate=1)
    measured = {k: memory_stats(s.lower(params, x).compile(FAST)).peak_bytes for k, s in (("first", step), ("off", off))}
    assert measured["first"] < measured["off"], measured

    loaded = planner.Plan.from_json(plan.to_json()).bind(params, x, mesh=plan.jax_mesh, out_tree=plan.out_tree)
    assert loaded.levers.remat.scan_layers == rec.scan_layers
    fresh = trace(_linear_step, params, x)
    with jax.sharding.set_mesh(loaded._mesh()):
        again = jit_planned(graph_for(fresh, loaded), loaded)(*jax.device_put((params, x), loaded.in_shardings))
    assert max_abs_diff(again, (new_params, loss, grads)) == 0.0  # the same program
