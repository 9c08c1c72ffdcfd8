"""A BERT encoder trained with masked language modelling.

Bidirectional self-attention (no causal mask), token + position + token-type embeddings, post-norm
blocks (LayerNorm after each residual add), and an MLM head tied to the token embedding. Token types
follow a fixed two-segment layout (the first half of each sequence is segment 0, the rest segment 1)
so the batch stays {"inputs", "targets", "mask"}.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from zoo.gpt import SelfAttention
from zoo.train import (
    ModelBundle,
    build_bundle,
    make_optimizer,
    resolve_dtype,
    validate_config,
)

_INIT = nn.initializers.normal(stddev=0.02)
_TYPE_VOCAB = 2


@dataclasses.dataclass(frozen=True, slots=True)
class BertConfig:
    """Sizes and training settings of a BERT encoder.

    Attributes:
      batch: sequences per step.
      seq: tokens per sequence (also the size of the learned position table).
      vocab: vocabulary size; token vocab - 1 is [MASK].
      d_model: hidden width; must be divisible by heads.
      heads: attention heads.
      layers: encoder blocks.
      mlp_dim: hidden width of the feed-forward network (4 * d_model in BERT).
      mask_rate: fraction of positions masked and predicted.
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
    mlp_dim: int
    mask_rate: float = 0.15
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)
        if not 0 < self.mask_rate <= 1:
            raise ValueError(f"BertConfig.mask_rate={self.mask_rate} must be in (0, 1]")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class EncoderBlock(nn.Module):
    """Post-norm block: x = ln(x + attn(x)); x = ln(x + ffn(x))."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=1e-12, dtype=dtype, param_dtype=jnp.float32)
        dense = functools.partial(nn.Dense, dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT)
        x = norm(name="ln_attn")(x + SelfAttention(cfg, causal=False, name="attn")(x))
        h = dense(cfg.d_model, name="fc_out")(nn.gelu(dense(cfg.mlp_dim, name="fc_in")(x)))
        return norm(name="ln_mlp")(x + h)


class Bert(nn.Module):
    """Embeddings + LayerNorm, blocks_0..blocks_{L-1}, MLM head (dense, GELU, LayerNorm, tied decoder)."""

    config: BertConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        embed = functools.partial(nn.Embed, dtype=dtype, param_dtype=jnp.float32, embedding_init=_INIT)
        norm = functools.partial(nn.LayerNorm, epsilon=1e-12, dtype=dtype, param_dtype=jnp.float32)
        seq = tokens.shape[1]
        positions = jax.lax.iota(jnp.int32, seq)  # one op at a symbolic length too (`jnp.arange` adds two)
        token_types = (positions >= seq // 2).astype(jnp.int32)
        word = embed(cfg.vocab, cfg.d_model, name="word_embed")
        x = word(tokens)
        x = x + embed(cfg.seq, cfg.d_model, name="position_embed")(positions)[None]
        x = x + embed(_TYPE_VOCAB, cfg.d_model, name="type_embed")(token_types)[None]
        x = norm(name="ln_embed")(x)
        for i in range(cfg.layers):
            x = EncoderBlock(cfg, name=f"blocks_{i}")(x)
        h = nn.Dense(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT,
                     name="mlm_dense")(x)
        h = norm(name="mlm_ln")(nn.gelu(h))
        bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab,), jnp.float32)
        return word.attend(h).astype(jnp.float32) + bias


def build(name: str, config: BertConfig) -> ModelBundle:
    """Builds the BERT bundle: batch {"inputs": int32[B, S], "targets": int32[B, S],
    "mask": f32[B, S]}; loss = cross entropy averaged over the masked positions only."""
    model = Bert(config)
    mask_token = config.vocab - 1

    def init_params(key: jax.Array):
        return model.init(key, jnp.zeros((1, config.seq), jnp.int32))["params"]

    def make_batch(key: jax.Array):
        k_tokens, k_mask = jax.random.split(key)
        shape = (config.batch, config.seq)
        targets = jax.random.randint(k_tokens, shape, 0, mask_token, jnp.int32)
        mask = jax.random.bernoulli(k_mask, config.mask_rate, shape)
        return {
            "inputs": jnp.where(mask, mask_token, targets),
            "targets": targets,
            "mask": mask.astype(jnp.float32),
        }

    def loss_fn(params, batch) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
