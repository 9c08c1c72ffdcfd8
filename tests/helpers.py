"""Shared test helpers: models with known answers and comparisons against the unsharded program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from planner.models import get_model

# MLP shapes with a textbook answer (2-layer MLP, AdamW):
# batch >> hidden: activations dwarf weights -> data parallel (one combined gradient all-reduce);
# hidden >> batch: weights dwarf activations -> Megatron (column then row split, one activation all-reduce).
TALL = dict(batch=16384, in_dim=64, hidden=64, out_dim=64)
WIDE = dict(batch=16, in_dim=256, hidden=8192, out_dim=256)


def concrete(name: str, **overrides):
    b = get_model(name, **overrides)
    return b, b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))


def max_abs_diff(a, b) -> float:
    diffs = jax.tree_util.tree_map(lambda x, y: float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs), default=0.0)


def assert_trees_close(a, b, rtol=1e-4, atol=5e-5):
    """allclose per leaf. The atol allows for AdamW: it divides by sqrt(v), so summation-order noise in
    a near-zero gradient moves an update by a visible fraction of the learning rate (1e-3)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def assert_train_states_close(b, state, batch, new_state, ref_state, lr: float = 1e-3):
    """Compares two AdamW train-step results.

    Adam's first step moves each parameter by about lr * sign(gradient); where the true gradient
    is zero (a dead ReLU channel) the sign is that of summation-order noise, so those elements may
    differ by up to 2 * lr. Everywhere else the usual tolerance applies. Non-parameter state
    (optimizer moments, batch statistics) is compared as it is.
    """
    grads = jax.grad(b.loss_fn)(state["params"], batch)
    for (path, got), want, g in zip(jax.tree_util.tree_leaves_with_path(new_state["params"]),
                                    jax.tree_util.tree_leaves(ref_state["params"]),
                                    jax.tree_util.tree_leaves(grads)):
        got, want, g = (np.asarray(v, np.float32) for v in (got, want, g))
        noisy = np.abs(g) < 1e-6 * max(1.0, float(np.abs(g).max()))
        np.testing.assert_allclose(got[~noisy], want[~noisy], rtol=1e-4, atol=5e-5,
                                   err_msg=jax.tree_util.keystr(path))
        assert np.all(np.abs(got[noisy] - want[noisy]) <= 2 * lr + 1e-6), jax.tree_util.keystr(path)
    rest = {k: v for k, v in new_state.items() if k != "params"}
    assert_trees_close(rest, {k: v for k, v in ref_state.items() if k != "params"})
