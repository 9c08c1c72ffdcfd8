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
from planner.graph.scan_remat import is_recomputed, recomputable_scans, recompute_scans, scan_pairs
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
