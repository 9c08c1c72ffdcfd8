"""A GShard mixture-of-experts transformer: top-2 gating with capacity, einsum dispatch and combine.

Tokens are cut into groups of `group_size`; per group the gate picks each token's two best experts,
drops tokens past an expert's capacity, and builds the GShard tensors
  dispatch bool[groups, group_size, experts, capacity]   (which slot of which expert a token fills)
  combine  f32[groups, group_size, experts, capacity]    (dispatch weighted by the gate)
so that routing is three einsums: tokens -> expert slots, the expert FFN on stacked weights
wi f32[experts, d_model, mlp_dim] / wo f32[experts, mlp_dim, d_model], and slots -> tokens.
Sharding the `experts` axis of those einsums is expert parallelism (an all-to-all around the FFN).
Every `moe_every`-th layer is an MoE layer, the others are dense; the GShard load-balancing loss of
each MoE layer is added to the language-model loss.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo import gpt
from zoo.lm import next_token_batch, next_token_loss
from zoo.train import (
    ModelBundle,
    build_bundle,
    make_optimizer,
    resolve_dtype,
    validate_config,
)

_INIT = nn.initializers.normal(stddev=0.02)
_TOP_K = 2


@dataclasses.dataclass(frozen=True, slots=True)
class MoEConfig:
    """Sizes and training settings of a GShard MoE transformer.

    Attributes:
      batch: sequences per step.
      seq: tokens per sequence.
      vocab: vocabulary size.
      d_model: residual stream width; must be divisible by heads.
      heads: attention heads.
      layers: transformer blocks.
      experts: experts per MoE layer.
      mlp_dim: hidden width of every expert FFN and of the dense FFNs.
      group_size: tokens per routing group; must divide batch * seq.
      moe_every: layer i is MoE when (i + 1) % moe_every == 0 (2: every other layer, 1: all).
      capacity_factor: expert capacity as a multiple of the even share, top_k * group_size / experts.
      aux_loss_weight: weight of the load-balancing loss added to the LM loss.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters and gating stay float32.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
    """

    batch: int
    seq: int
    vocab: int
    d_model: int
    heads: int
    layers: int
    experts: int
    mlp_dim: int
    group_size: int
    moe_every: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)
        if (self.batch * self.seq) % self.group_size:
            raise ValueError(
                f"MoEConfig.group_size={self.group_size} does not divide batch * seq = "
                f"{self.batch * self.seq} tokens; choose a divisor, e.g. group_size={self.seq}"
            )
        if self.experts < _TOP_K:
            raise ValueError(f"MoEConfig.experts={self.experts} must be >= {_TOP_K} for top-2 gating")

    @property
    def capacity(self) -> int:
        """Slots per expert per group: ceil(capacity_factor * top_k * group_size / experts)."""
        return max(1, math.ceil(self.capacity_factor * _TOP_K * self.group_size / self.experts))

    def is_moe_layer(self, i: int) -> bool:
        return (i + 1) % self.moe_every == 0

    def attention_config(self) -> gpt.GPTConfig:
        """The GPT config whose attention this model reuses (same width, heads and dtype)."""
        return gpt.GPTConfig(
            batch=self.batch, seq=self.seq, vocab=self.vocab, d_model=self.d_model,
            heads=self.heads, layers=self.layers, dtype=self.dtype,
        )


def top2_routing(
    logits: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating for logits f32[groups, tokens, experts].

    Returns:
      (dispatch bool[G, S, E, C], combine f32[G, S, E, C], aux_loss scalar). A token's first choice
      takes slots before any second choice; tokens past an expert's capacity are dropped (their
      combine weight is zero, so they pass through the residual only). Deterministic: no random
      second-expert routing.
    """
    experts = logits.shape[-1]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    index1 = jnp.argmax(probs, axis=-1)
    mask1 = jax.nn.one_hot(index1, experts, dtype=jnp.float32)
    index2 = jnp.argmax(probs * (1.0 - mask1), axis=-1)
    mask2 = jax.nn.one_hot(index2, experts, dtype=jnp.float32)

    # Load balancing (GShard eq. 4): fraction of tokens whose first choice is e, times mean gate.
    density = jnp.mean(mask1, axis=1)
    density_proxy = jnp.mean(probs, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * experts * experts

    # Slot of each token in its expert's buffer: a running count over the group.
    position1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (position1 < capacity)
    filled1 = jnp.sum(mask1, axis=1, keepdims=True)
    position2 = jnp.cumsum(mask2, axis=1) - mask2 + filled1
    mask2 = mask2 * (position2 < capacity)

    gate1 = jnp.sum(probs * mask1, axis=-1)
    gate2 = jnp.sum(probs * mask2, axis=-1)
    norm = jnp.maximum(gate1 + gate2, jnp.finfo(jnp.float32).eps)
    gate1, gate2 = gate1 / norm, gate2 / norm

    slot1 = jax.nn.one_hot(jnp.sum(position1 * mask1, axis=-1).astype(jnp.int32), capacity)
    slot2 = jax.nn.one_hot(jnp.sum(position2 * mask2, axis=-1).astype(jnp.int32), capacity)
    combine = (gate1[..., None, None] * mask1[..., None] * slot1[..., None, :]
               + gate2[..., None, None] * mask2[..., None] * slot2[..., None, :])
    return combine > 0, combine, aux_loss


class MoEFFN(nn.Module):
    """Top-2 routed expert FFNs with stacked weights; returns (output, load-balancing loss)."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        batch, seq, d_model = x.shape
        groups = x.reshape(batch * seq // cfg.group_size, cfg.group_size, d_model)
        gate = self.param("gate", _INIT, (d_model, cfg.experts), jnp.float32)
        wi = self.param("wi", _INIT, (cfg.experts, d_model, cfg.mlp_dim), jnp.float32)
        wo = self.param("wo", _INIT, (cfg.experts, cfg.mlp_dim, d_model), jnp.float32)

        logits = jnp.einsum("gsm,me->gse", groups.astype(jnp.float32), gate)
        dispatch, combine, aux_loss = top2_routing(logits, cfg.capacity)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(dtype), groups)
        hidden = nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, wi.astype(dtype)))
        expert_out = jnp.einsum("egch,ehm->egcm", hidden, wo.astype(dtype))
        out = jnp.einsum("gsec,egcm->gsm", combine.astype(dtype), expert_out)
        return out.reshape(batch, seq, d_model), aux_loss


class DenseFFN(nn.Module):
    """Dense(mlp_dim) -> GELU -> Dense(d_model), the non-MoE layers' FFN."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = functools.partial(
            nn.Dense, dtype=resolve_dtype(cfg.dtype), param_dtype=jnp.float32, kernel_init=_INIT
        )
        return dense(cfg.d_model, name="fc_out")(nn.gelu(dense(cfg.mlp_dim, name="fc_in")(x)))


class MoEBlock(nn.Module):
    """Pre-LayerNorm block with GPT attention and a dense or MoE FFN; returns (x, aux_loss)."""

    config: MoEConfig
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        norm = functools.partial(
            nn.LayerNorm, epsilon=1e-5, dtype=resolve_dtype(cfg.dtype), param_dtype=jnp.float32
        )
        x = x + gpt.SelfAttention(cfg.attention_config(), name="attn")(norm(name="ln_1")(x))
        h = norm(name="ln_2")(x)
        if self.moe:
            out, aux_loss = MoEFFN(cfg, name="moe")(h)
        else:
            out, aux_loss = DenseFFN(cfg, name="mlp")(h), jnp.zeros((), jnp.float32)
        return x + out, aux_loss


class MoETransformer(nn.Module):
    """Token + position embeddings, blocks_0..blocks_{L-1}, final LayerNorm, untied LM head."""

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        embed = functools.partial(nn.Embed, dtype=dtype, param_dtype=jnp.float32, embedding_init=_INIT)
        positions = jax.lax.iota(jnp.int32, tokens.shape[1])  # one op at a symbolic length too (`jnp.arange` adds two)
        x = embed(cfg.vocab, cfg.d_model, name="wte")(tokens)
        x = x + embed(cfg.seq, cfg.d_model, name="wpe")(positions)[None, :, :]
        aux_total = jnp.zeros((), jnp.float32)
        for i in range(cfg.layers):
            x, aux_loss = MoEBlock(cfg, moe=cfg.is_moe_layer(i), name=f"blocks_{i}")(x)
            aux_total = aux_total + aux_loss
        x = nn.LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=jnp.float32, name="ln_f")(x)
        logits = nn.Dense(
            cfg.vocab, use_bias=False, dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT,
            name="lm_head",
        )(x)
        return logits.astype(jnp.float32), aux_total


def build(name: str, config: MoEConfig) -> ModelBundle:
    """Builds the MoE bundle: batch {"inputs", "targets"} int32[B, S]; loss = LM loss + weighted aux.

    MoE layers hold params {"gate": [d, E], "wi": [E, d, mlp_dim], "wo": [E, mlp_dim, d]} under
    params["blocks_i"]["moe"].
    """
    model = MoETransformer(config)

    def init_params(key: jax.Array):
        # The full batch, not one row: routing groups may span sequences.
        return model.init(key, jnp.zeros((config.batch, config.seq), jnp.int32))["params"]

    def make_batch(key: jax.Array):
        return next_token_batch(key, config.batch, config.seq, config.vocab)

    def loss_fn(params, batch) -> jax.Array:
        logits, aux_loss = model.apply({"params": params}, batch["inputs"])
        return next_token_loss(logits, batch["targets"]) + config.aux_loss_weight * aux_loss

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
