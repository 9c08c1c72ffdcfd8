"""A small train step that pipelines (four tanh blocks and a head, Adam), shared by the pipeline
tests that run it in one process and across two (tests/multihost_worker.py); not collected."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

OPT = optax.adam(1e-2)


def loss(params, x, y):
    h = x
    for i, w in enumerate(params["ws"]):
        with jax.named_scope(f"blocks_{i}"):
            h = jnp.tanh(h @ w)
    return jnp.mean((h @ params["head"] - y) ** 2)


def step(params, opt_state, x, y):
    l, g = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = OPT.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, l


def inputs():
    """(params, opt_state, x, y), the same in every process."""
    params = {"ws": [jax.random.normal(jax.random.key(i), (64, 64)) * 0.1 for i in range(4)],
              "head": jax.random.normal(jax.random.key(7), (64, 4)) * 0.1}
    x, y = jax.random.normal(jax.random.key(8), (32, 64)), jax.random.normal(jax.random.key(9), (32, 4))
    return params, OPT.init(params), x, y
