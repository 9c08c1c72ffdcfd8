"""Next-token data and loss shared by the decoder-only language models (GPT, Llama, MoE)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def next_token_batch(key: jax.Array, batch: int, seq: int, vocab: int) -> dict[str, jax.Array]:
    """A batch {"inputs", "targets"} of int32[batch, seq]; targets are the inputs shifted by one.

    One random stream of seq + 1 tokens per row is cut twice, so the model has a learnable signal
    (the next token is in the input of the next position) and losses fall within a few steps.
    """
    tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy of float32 logits [..., vocab] against int targets [...]."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def causal_mask(seq: int) -> jax.Array:
    """bool[seq, seq], True where query row may attend to key column; built from iota, not stored."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (seq, seq), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (seq, seq), 1)
    return rows >= cols
