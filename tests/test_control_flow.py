"""Control flow: scan, while_loop and cond bodies are planned op by op (scans once per body: the
iterations share one decision set), and the emitted program keeps its loops and branches."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import planner
from zoo import get_model


def _scan_loss(c, xs):
    def body(carry, x):
        return jnp.tanh(carry @ x), carry.sum()

    final, ys = jax.lax.scan(body, c, xs)
    return final.sum() + ys.sum()


def test_scan_with_grad_matches_unsharded(devices8):
    c = jnp.ones((8, 16)) / 4
    xs = jnp.linspace(0, 1, 4 * 16 * 16).reshape(4, 16, 16)
    fn = jax.value_and_grad(_scan_loss, argnums=(0, 1))
    step = planner.plan_parallel(fn, mesh="2x4")
    for a, b in zip(jax.tree_util.tree_leaves(step(c, xs)), jax.tree_util.tree_leaves(jax.jit(fn)(c, xs))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not step.plan(c, xs).fallback_primitives
    # The emitted program loops (forward and backward scans), it is not the unrolled plan.
    hlo = step.lower(c, xs).compile().as_text()
    assert hlo.count(" while(") >= 2


def test_scanned_layers_plan_once():
    sizes = {}
    for layers in (2, 4):
        b = get_model("llama-tiny", layers=layers)
        p = planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh="2x4")
        sizes[layers] = (p.solver.decisions, p.solver.variables_shared)
        stacked = [s for path, s in zip(p.input_paths, p.input_specs) if path.startswith("[0]['params']['layers']")]
        assert stacked and all(s[0] == () for s in stacked)  # the layer dim is never split
    assert sizes[4][0] > sizes[2][0]  # more layers, more ops ...
    assert sizes[4][1] == sizes[2][1]  # ... but the same number of distinct decisions


def test_while_loop_and_cond(devices8):
    def f(x, w):
        y = jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v @ w), x)
        z = jax.lax.cond(y.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, y)
        return (z ** 2).sum()

    x, w = jnp.ones((8, 16)) / 8, jnp.eye(16) * 0.5
    fn = jax.value_and_grad(f, argnums=1)
    step = planner.plan_parallel(fn, mesh="2x4")
    for a, b in zip(jax.tree_util.tree_leaves(step(x, w)), jax.tree_util.tree_leaves(jax.jit(fn)(x, w))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not step.plan(x, w).fallback_primitives


def test_dynamic_while_loop_planned_inside(devices8):
    """A loop whose trip count depends on data: its body's ops are planned, its carry keeps one
    sharding across iterations, and the loop runs as a loop."""

    def f(x, w):
        def cond(c):
            return (c[1] < 5) & (jnp.sum(c[0] ** 2) < 1e6)

        def body(c):
            return jnp.tanh(c[0] @ w) * 1.5, c[1] + 1

        y, n = jax.lax.while_loop(cond, body, (x, 0))
        return y.sum() * n

    x, w = jnp.linspace(0.1, 1, 64 * 32).reshape(64, 32), jnp.eye(32) * 0.9
    step = planner.plan_parallel(f, mesh="1x8")
    np.testing.assert_allclose(step(x, w), jax.jit(f)(x, w), rtol=1e-5)  # 5 iterations ran in both
    plan = step.plan(x, w)
    assert not plan.fallback_primitives
    assert " while(" in step.lower(x, w).compile().as_text()


def test_cond_branches_share_result_sharding(devices8):
    def f(p, x, w):
        return jax.lax.cond(p > 0, lambda v: jnp.tanh(v @ w), lambda v: (v * 2.0) @ w, x).sum()

    x, w = jnp.ones((64, 32)) / 8, jnp.ones((32, 32)) / 32
    for p in (jnp.int32(1), jnp.int32(-1)):
        step = planner.plan_parallel(f, mesh="2x4")
        np.testing.assert_allclose(step(p, x, w), jax.jit(f)(p, x, w), rtol=1e-4)
    graph = step.graph(p, x, w)
    assert any(r.kind == "cond" and len(r.bodies) == 2 for rs in graph.regions.values() for r in rs)
    assert not step.plan(p, x, w).fallback_primitives
