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
