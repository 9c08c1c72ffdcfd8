"""A Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied head.

Layers are scanned by default (`nn.scan` over one DecoderLayer, params stacked on a leading layer
axis, as MaxText's scan_layers), so the jaxpr holds one `scan` whose body is a single layer: the
planner must plan that body once, not `layers` times. `scan_layers=False` gives a Python loop of
layers_0, layers_1, ... instead, with the same parameter count; `remat=True` wraps the layer in
`nn.remat` (a `checkpoint` region inside the scan body).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention

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
class LlamaConfig:
    """Sizes and training settings of a Llama.

    Attributes:
      batch: sequences per step.
      seq: tokens per sequence.
      vocab: vocabulary size.
      d_model: residual stream width; must be divisible by heads.
      heads: query heads.
      kv_heads: key/value heads; heads must be a multiple (kv_heads == heads is plain multi-head).
      layers: decoder layers.
      mlp_dim: hidden width of the SwiGLU MLP (11008 for Llama-7B).
      scan_layers: scan one layer over stacked params instead of unrolling a Python loop.
      remat: rematerialise each layer in the backward pass (nn.remat).
      attention: "xla" (the scores materialised: einsum, mask, softmax, einsum), "fused" (Pallas
        flash attention, `jax.experimental.pallas.ops.gpu.attention.mha`, as GPU trainers run it;
        interpreted on CPU; key/value heads repeated to the query heads, which that kernel needs) or
        "dpa" (`jax.nn.dot_product_attention`: XLA's attention where it is traced, cuDNN's fused
        kernel on a GPU, and so priced for GPU and TPU targets).
      rope_theta: base of the rotary frequencies.
      norm_eps: RMSNorm epsilon.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
    """

    batch: int
    seq: int
    vocab: int
    d_model: int
    heads: int
    kv_heads: int
    layers: int
    mlp_dim: int
    scan_layers: bool = True
    remat: bool = False
    attention: str = "xla"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)
        if self.attention not in ("xla", "fused", "dpa"):
            raise ValueError(f"LlamaConfig.attention={self.attention!r} must be 'xla', 'fused' or 'dpa'")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig.heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "grouped-query attention shares each kv head among heads // kv_heads query heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head_dim={self.head_dim} (d_model // heads) must be even for rotary "
                "embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotates x [batch, seq, heads, head_dim] by position-dependent angles (rotate-half RoPE)."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    # `lax.iota`: one op at a symbolic length too (`jnp.arange` adds a multiply and an add)
    angles = jax.lax.iota(jnp.float32, seq)[:, None] * freqs[None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal flash attention over [batch, seq, heads, head_dim] (Pallas's GPU kernel, its default
    128-row blocks where the sequence allows; run by the Pallas interpreter on a CPU backend)."""
    seq = q.shape[1]
    block = math.gcd(seq, 128)
    back = math.gcd(seq, 64)
    sizes = attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=back, block_kv_dkv=back,
                                 block_q_dq=back, block_kv_dq=back)
    return attention.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(q.shape[-1]), causal=True, block_sizes=sizes,
                         interpret=jax.default_backend() == "cpu")


class Attention(nn.Module):
    """Causal grouped-query attention: `heads` query heads share `kv_heads` key/value heads."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        proj = functools.partial(
            nn.DenseGeneral, use_bias=False, dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT
        )
        q = proj(features=(cfg.heads, cfg.head_dim), name="query")(x)
        k = proj(features=(cfg.kv_heads, cfg.head_dim), name="key")(x)
        v = proj(features=(cfg.kv_heads, cfg.head_dim), name="value")(x)
        q = rotary(q, cfg.rope_theta)
        k = rotary(k, cfg.rope_theta)
        batch, seq = x.shape[:2]
        group = cfg.heads // cfg.kv_heads
        if cfg.attention == "fused":
            out = fused_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2))
            return proj(features=cfg.d_model, axis=(-2, -1), name="out")(out)
        if cfg.attention == "dpa":
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            return proj(features=cfg.d_model, axis=(-2, -1), name="out")(out)
        q = q.reshape(batch, seq, cfg.kv_heads, group, cfg.head_dim)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
        scores = scores / math.sqrt(cfg.head_dim)
        scores = jnp.where(causal_mask(seq), scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
        out = out.reshape(batch, seq, cfg.heads, cfg.head_dim)
        return proj(features=cfg.d_model, axis=(-2, -1), name="out")(out)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama MLP."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = functools.partial(
            nn.Dense,
            use_bias=False,
            dtype=resolve_dtype(cfg.dtype),
            param_dtype=jnp.float32,
            kernel_init=_INIT,
        )
        h = nn.silu(dense(cfg.mlp_dim, name="gate")(x)) * dense(cfg.mlp_dim, name="up")(x)
        return dense(cfg.d_model, name="down")(h)


class DecoderLayer(nn.Module):
    """x + attn(rms(x)), then x + mlp(rms(x)); returns (x, None) so nn.scan can carry x."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        cfg = self.config
        norm = functools.partial(
            nn.RMSNorm, epsilon=cfg.norm_eps, dtype=resolve_dtype(cfg.dtype), param_dtype=jnp.float32
        )
        x = x + Attention(cfg, name="attn")(norm(name="attn_norm")(x))
        x = x + SwiGLU(cfg, name="mlp")(norm(name="mlp_norm")(x))
        return x, None


class Llama(nn.Module):
    """Token embedding, `layers` DecoderLayers (scanned or looped), final RMSNorm, untied LM head."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        x = nn.Embed(
            cfg.vocab, cfg.d_model, dtype=dtype, param_dtype=jnp.float32, embedding_init=_INIT,
            name="embed",
        )(tokens)
        layer = DecoderLayer
        if cfg.remat:
            # Inside a scan the loop boundary already stops CSE across layers.
            layer = nn.remat(layer, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.layers):
                x, _ = layer(cfg, name=f"layers_{i}")(x, None)
        x = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32, name="norm")(x)
        logits = nn.Dense(
            cfg.vocab, use_bias=False, dtype=dtype, param_dtype=jnp.float32, kernel_init=_INIT,
            name="lm_head",
        )(x)
        return logits.astype(jnp.float32)


def build(name: str, config: LlamaConfig) -> ModelBundle:
    """Builds the Llama bundle: batch {"inputs", "targets"} int32[B, S], mean next-token cross entropy.

    With scan_layers, every per-layer parameter has a leading axis of size `layers`, e.g.
    params["layers"]["attn"]["query"]["kernel"]: f32[layers, d_model, heads, head_dim].
    """
    model = Llama(config)

    def init_params(key: jax.Array):
        return model.init(key, jnp.zeros((1, config.seq), jnp.int32))["params"]

    def make_batch(key: jax.Array):
        return next_token_batch(key, config.batch, config.seq, config.vocab)

    def loss_fn(params, batch) -> jax.Array:
        return next_token_loss(model.apply({"params": params}, batch["inputs"]), batch["targets"])

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
