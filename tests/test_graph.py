"""Tracing: nested calls inlined, name stacks and input paths kept, abstract arguments accepted."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner.graph.trace import trace


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))


def _loss(params, x):
    h = jax.nn.relu(x @ params["w"])  # relu is a custom_jvp inside a nested jit
    h = jax.checkpoint(lambda z: jnp.tanh(z) * 2.0)(h)
    h = jax.jit(lambda z: z + 1.0)(h)
    return _sin(h).sum()


def test_nested_calls_are_inlined_and_evaluate_identically():
    params = {"w": jnp.arange(12.0).reshape(4, 3) / 10}
    x = jnp.ones((2, 4))
    fn = jax.value_and_grad(_loss)
    g = trace(fn, params, x)
    names = {op.name for op in g.ops}
    assert not names & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"}
    assert "dot_general" in names
    got = g.evaluate(jax.tree_util.tree_leaves((params, x)))
    want = jax.tree_util.tree_leaves(fn(params, x))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_input_paths_and_abstract_arguments():
    params = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
    x = jax.ShapeDtypeStruct((2, 4), jnp.float32)
    g = trace(jax.value_and_grad(_loss), params, x)
    assert g.input_paths == ("[0]['w']", "[1]")
    assert g.output_paths == ("[0]", "[1]['w']")
    assert g.tensors[g.inputs[0]].shape == (4, 3)


def test_flax_name_stack_is_kept():
    from zoo import get_model

    b = get_model("gpt-tiny")
    g = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    stacks = {op.name_stack for op in g.ops}
    assert any("blocks_0" in s for s in stacks) and any("blocks_1" in s for s in stacks)
    assert any(p.startswith("[0]['params']['blocks_0']") for p in g.input_paths)


def test_non_array_leaf_is_a_clear_error():
    with pytest.raises(planner.InvalidArgumentError, match=r"\[1\]\['lr'\].*not an array"):
        trace(lambda p, h: p, jnp.ones(3), {"lr": "fast"})
