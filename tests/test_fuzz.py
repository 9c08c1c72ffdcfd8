"""Property-based fuzzing: random programs from supported primitives, planned on random meshes,
must plan without crashing and compute exactly what the unsharded program computes.

The suite runs a small fixed sample (FUZZ_EXAMPLES, default 12 per mesh, derandomized so every run
draws the same programs); `make fuzz` runs the scale (FUZZ_EXAMPLES=1000 per mesh).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))
MESHES = ["1x8", "2x4", "4x2", "2x2x2"]
DIMS = (8, 16)

# Each op maps (value, aux) -> value; aux is a second input of the value's shape.
UNARY = {
    "tanh": jnp.tanh, "sin": jnp.sin, "abs": jnp.abs, "neg": jnp.negative,
    "exp": lambda v: jnp.exp(-v * v), "square": lambda v: v * v, "relu": jax.nn.relu,
    "softmax": lambda v: jax.nn.softmax(v, axis=-1), "cumsum": lambda v: jnp.cumsum(v, axis=-1) / v.shape[-1],
    "bf16": lambda v: v.astype(jnp.bfloat16).astype(jnp.float32),
}


def _apply(kind: str, v, w):
    if kind in UNARY:
        return UNARY[kind](v)
    if kind == "add_aux":
        return v + w
    if kind == "mul_aux":
        return v * jnp.tanh(w)
    if kind == "reduce_bcast":
        return v - jnp.mean(v, axis=0, keepdims=True)
    if kind == "max_bcast":
        return v - jnp.max(v, axis=-1, keepdims=True)
    if kind == "transpose":
        return jnp.swapaxes(v, 0, -1) if v.shape[0] == v.shape[-1] else v.T if v.ndim == 2 else v
    if kind == "matmul":
        return v @ (jnp.eye(v.shape[-1]) * 0.5 + 0.01)
    if kind == "reshape":
        return v.reshape(-1, v.shape[-1]) if v.ndim == 3 else v.reshape(v.shape[0], 2, v.shape[1] // 2).sum(1) / 2
    if kind == "where":
        return jnp.where(v > 0, v, 0.1 * w)
    if kind == "slice_concat":
        h = v.shape[-1] // 2
        return jnp.concatenate([v[..., h:], v[..., :h]], axis=-1)
    if kind == "scan":  # carry a row through the leading dim
        return jax.lax.scan(lambda c, r: (jnp.tanh(c + r), c * r), v[0], v)[1]
    if kind == "cond":
        return jax.lax.cond(jnp.sum(v) > 0, lambda a: a * 0.5, lambda a: jnp.sin(a), v)
    if kind == "while":
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0]) * 1.1, c[1] + 1), (v, 0))[0]
    if kind == "int_roundtrip":
        return (v * 8).astype(jnp.int32).astype(jnp.float32) / 8
    raise AssertionError(kind)


KINDS = sorted(UNARY) + ["add_aux", "mul_aux", "reduce_bcast", "max_bcast", "transpose", "matmul", "reshape",
                         "where", "slice_concat", "scan", "cond", "while", "int_roundtrip"]


@st.composite
def programs(draw):
    rank = draw(st.sampled_from([2, 3]))
    shape = tuple(draw(st.sampled_from(DIMS)) for _ in range(rank))
    ops = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=8))
    grad = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return shape, tuple(ops), grad, seed


def _make(ops):
    def fn(x, w):
        v = x
        for kind in ops:
            out = _apply(kind, v, w if w.shape == v.shape else jnp.zeros_like(v))
            v = out
        return jnp.sum(v * v) / v.size

    return fn


@pytest.mark.parametrize("mesh", MESHES)
def test_random_programs_match_unsharded(mesh, devices8):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs())
    def check(program):
        shape, ops, grad, seed = program
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        fn = _make(ops)
        if grad and "while" not in ops:  # JAX cannot differentiate a while_loop in reverse mode
            fn = jax.value_and_grad(fn, argnums=(0, 1))
        step = planner.plan_parallel(fn, mesh=mesh, solver_time_limit=10)
        got, want = step(x, w), jax.jit(fn)(x, w)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            tol = 2e-2 if "bf16" in ops else 1e-4
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol, err_msg=f"{ops} on {mesh}")

    check()
