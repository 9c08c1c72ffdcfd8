"""A GPT-2/GPT-3 style decoder-only transformer, the model every auto-parallel paper plans.

Written with ordinary ops only (dot_general, elementwise, reductions, gather for embeddings) and
layers as a Python loop of modules named blocks_0, blocks_1, ..., so the traced jaxpr is flat and
its name stack tells the planner which layer each op belongs to (needed for stage clustering).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.lm import causal_mask, next_token_batch, next_token_loss
from zoo.train import (
    ModelBundle,
    build_bundle,
    make_optimizer,
    resolve_dtype,
    validate_config,
)

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig:
    """Sizes and training settings of a GPT.

    Attributes:
      batch: sequences per step.
      seq: tokens per sequence (also the size of the learned position table).
      vocab: vocabulary size.
      d_model: residual stream width; must be divisible by heads.
      heads: attention heads.
      layers: transformer blocks.
      mlp_ratio: MLP hidden width as a multiple of d_model.
      tie_embeddings: reuse the token embedding as the LM head (saves vocab * d_model params).
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
    """

    batch: int
    seq: int
    vocab: int
    d_model: int
    heads: int
    layers: int
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class SelfAttention(nn.Module):
    """Multi-head self-attention, causal by default (the mask is built from iota comparisons, not a
    stored table); BERT uses it bidirectionally. `config` needs heads, head_dim, d_model, dtype."""

    config: Any
    causal: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        proj = functools.partial(
            nn.DenseGeneral,
            features=(cfg.heads, cfg.head_dim),
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=_INIT,
        )
        q = proj(name="query")(x)
        k = proj(name="key")(x)
        v = proj(name="value")(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(cfg.head_dim)
        if self.causal:
            scores = jnp.where(causal_mask(x.shape[1]), scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(
            features=cfg.d_model,
            axis=(-2, -1),
            dtype=dtype,
            param_dtype=jnp.float32,
            kernel_init=_INIT,
            name="out",
        )(out)


class MLPBlock(nn.Module):
    """The position-wise feed-forward network: Dense(mlp_ratio * d) -> GELU -> Dense(d)."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = functools.partial(
            nn.Dense, dtype=resolve_dtype(cfg.dtype), param_dtype=jnp.float32, kernel_init=_INIT
        )
        h = dense(cfg.mlp_ratio * cfg.d_model, name="fc_in")(x)
        h = nn.gelu(h)
        return dense(cfg.d_model, name="fc_out")(h)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = resolve_dtype(self.config.dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32)
        x = x + SelfAttention(self.config, name="attn")(norm(name="ln_1")(x))
        return x + MLPBlock(self.config, name="mlp")(norm(name="ln_2")(x))


class GPT(nn.Module):
    """Token + learned position embeddings, `layers` Blocks, final LayerNorm, LM head -> f32 logits."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        embed = functools.partial(nn.Embed, dtype=dtype, param_dtype=jnp.float32, embedding_init=_INIT)
        wte = embed(cfg.vocab, cfg.d_model, name="wte")
        wpe = embed(cfg.seq, cfg.d_model, name="wpe")
        positions = jax.lax.iota(jnp.int32, tokens.shape[1])  # one op at a symbolic length too (`jnp.arange` adds two)
        x = wte(tokens) + wpe(positions)[None, :, :]
        for i in range(cfg.layers):
            x = Block(cfg, name=f"blocks_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32, name="ln_f")(x)
        if cfg.tie_embeddings:
            logits = wte.attend(x)
        else:
            logits = nn.Dense(
                cfg.vocab,
                use_bias=False,
                dtype=dtype,
                param_dtype=jnp.float32,
                kernel_init=_INIT,
                name="lm_head",
            )(x)
        return logits.astype(jnp.float32)


def build(name: str, config: GPTConfig) -> ModelBundle:
    """Builds the GPT bundle: batch {"inputs", "targets"} int32[B, S], mean next-token cross entropy."""
    model = GPT(config)

    def init_params(key: jax.Array):
        tokens = jnp.zeros((1, config.seq), jnp.int32)
        return model.init(key, tokens)["params"]

    def make_batch(key: jax.Array):
        return next_token_batch(key, config.batch, config.seq, config.vocab)

    def loss_fn(params, batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"])
        return next_token_loss(logits, batch["targets"])

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
