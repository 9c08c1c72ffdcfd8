"""Which primitives fall back to the replicated rule on the programs people train: the zoo, a RoPE
transformer block built with `jnp.stack` (its backward has `unstack`) with dropout keys folded in,
`checkpoint_name` under a remat policy and a top-k MoE, and a flax nnx model with dropout. A common
primitive falling back fails the test (it costs performance silently)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import planner
from planner.ilp.rules import signature
from tests.helpers import assert_loss_close, assert_sgd_step_close, longest_reduction
from zoo import get_model

# Primitives a train step may contain that the planner deliberately leaves replicated: none today.
ALLOWED_FALLBACK: frozenset[str] = frozenset()
LR = 0.1


def fallbacks(graph) -> set[str]:
    return {op.name for op in graph.ops if not signature(op, graph).known}


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny", "llama-tiny", "moe-tiny", "wresnet-tiny", "bert-tiny",
                                  "plain-mlp-tiny", "nnx-mlp-tiny"])
def test_zoo_has_no_fallback(name):
    b = get_model(name)
    graph = planner.trace(b.train_step, b.abstract_state(), b.abstract_batch())
    assert fallbacks(graph) <= ALLOWED_FALLBACK, f"{name}: {sorted(fallbacks(graph) - ALLOWED_FALLBACK)}"


def _rope(x):
    b, s, d = x.shape
    pos = jnp.arange(s)[:, None] * jnp.exp(-jnp.arange(d // 2) / d)[None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    c, sn = jnp.cos(pos), jnp.sin(pos)
    return jnp.stack([x1 * c - x2 * sn, x1 * sn + x2 * c], axis=-1).reshape(b, s, d)


def _block(p, x, key):
    q, k = _rope(x @ p["wq"]), _rope(x @ p["wk"])
    att = jax.nn.softmax(q @ k.transpose(0, 2, 1) / 4.0, axis=-1)
    h = checkpoint_name(att @ (x @ p["wv"]), "attn_out")
    keep = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    vals, idx = jax.lax.top_k(h @ p["router"], 2)  # top-2 of 4 experts
    dispatch = jnp.einsum("bsk,bske->bse", jax.nn.softmax(vals, axis=-1), jax.nn.one_hot(idx, 4))
    experts = jnp.einsum("bsd,edf->bsef", h, p["experts"])
    return x + jnp.einsum("bse,bsef->bsf", dispatch, experts)


def _loss(p, batch):
    x, key = batch
    block = jax.checkpoint(_block, policy=jax.checkpoint_policies.save_only_these_names("attn_out"))
    for k in jax.random.split(key, 1):  # one block: the primitives, not depth, are under test
        x = block(p, x, k)
    return jnp.mean(x ** 2)


def _step(p, batch):
    value, g = jax.value_and_grad(_loss)(p, batch)
    return jax.tree.map(lambda a, d: a - LR * d, p, g), value


def test_rope_dropout_remat_topk_moe_step(devices8):
    keys = jax.random.split(jax.random.key(0), 6)
    p = {n: jax.random.normal(k, s) * 0.3 for n, k, s in zip(
        ("wq", "wk", "wv", "router", "experts"), keys,
        ((16, 16), (16, 16), (16, 16), (16, 4), (4, 16, 16)))}
    batch = (jax.random.normal(keys[5], (8, 8, 16)), jax.random.key(1, impl="unsafe_rbg"))
    planned = planner.plan_parallel(_step, mesh=(8,))
    graph = planned.graph(p, batch)
    assert {"unstack", "name", "random_fold_in", "random_split", "top_k"} <= {op.name for op in graph.ops}
    assert fallbacks(graph) <= ALLOWED_FALLBACK, sorted(fallbacks(graph))
    new, value = planned(p, batch)
    n = longest_reduction(jax.grad(_loss), p, batch)
    assert_loss_close(value, jax.jit(_loss)(p, batch), n)
    # per-example bound: the dropout keys are shared by the batch, so examples are vmapped with one key
    assert_sgd_step_close(lambda q, x: _loss(q, (x, batch[1])), LR, p, batch[0], new, n=n)


def test_nnx_model_with_dropout():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)
            self.norm, self.drop = nnx.LayerNorm(32, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(self.norm(jax.nn.gelu(self.l1(x)))))

    graphdef, params, rest = nnx.split(Model(nnx.Rngs(0, dropout=1)), nnx.Param, ...)

    def step(params, rest, x):
        model = nnx.merge(graphdef, params, rest)
        value, g = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        _, new_params, new_rest = nnx.split(model, nnx.Param, ...)
        return jax.tree.map(lambda a, d: a - LR * d, new_params, g), new_rest, value

    graph = planner.trace(step, params, rest, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert "random_bits" in {op.name for op in graph.ops}
    assert fallbacks(graph) <= ALLOWED_FALLBACK, sorted(fallbacks(graph))
