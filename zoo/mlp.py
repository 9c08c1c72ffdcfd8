"""A stack of Dense layers with ReLU and an MSE loss: the smallest model whose shardings are non-trivial.

Its shapes are chosen per size so that the best plan differs: "mlp-wide" (hidden >> batch) favours
sharding the weights, "mlp-tall" (batch >> hidden) favours sharding the batch.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from zoo.train import (
    ModelBundle,
    build_bundle,
    make_optimizer,
    resolve_dtype,
    validate_config,
)


@dataclasses.dataclass(frozen=True, slots=True)
class MLPConfig:
    """Sizes and training settings of an MLP.

    Attributes:
      batch: examples per step.
      in_dim: input features.
      hidden: width of every hidden layer.
      out_dim: output features (the regression target's width).
      layers: number of Dense layers; ReLU between consecutive ones.
      use_bias: whether the Dense layers carry a bias.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
    """

    batch: int
    in_dim: int
    hidden: int
    out_dim: int
    layers: int = 2
    use_bias: bool = True
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)


class MLP(nn.Module):
    """`layers` Dense layers named dense_0, dense_1, ... so the planner's name stack tells them apart."""

    config: MLPConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        x = x.astype(dtype)
        for i in range(cfg.layers):
            features = cfg.out_dim if i == cfg.layers - 1 else cfg.hidden
            x = nn.Dense(
                features,
                use_bias=cfg.use_bias,
                dtype=dtype,
                param_dtype=jnp.float32,
                name=f"dense_{i}",
            )(x)
            if i < cfg.layers - 1:
                x = nn.relu(x)
        return x


def build(name: str, config: MLPConfig) -> ModelBundle:
    """Builds the MLP bundle: batch {"x": f32[B, in], "y": f32[B, out]}, mean squared error loss."""
    model = MLP(config)

    def init_params(key: jax.Array):
        x = jnp.zeros((1, config.in_dim), jnp.float32)
        return model.init(key, x)["params"]

    def make_batch(key: jax.Array):
        kx, ky = jax.random.split(key)
        return {
            "x": jax.random.normal(kx, (config.batch, config.in_dim), jnp.float32),
            "y": jax.random.normal(ky, (config.batch, config.out_dim), jnp.float32),
        }

    def loss_fn(params, batch) -> jax.Array:
        pred = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return jnp.mean(jnp.square(pred - batch["y"]))

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
