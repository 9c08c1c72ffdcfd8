"""A classifier written in plain JAX (jnp only, no flax): the style of a user without a framework.

Its params are a nested dict with a None leaf (the output layer has no bias) and its batch holds
integer class labels, both things the planner must carry through without a rule for them.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from zoo.train import ModelBundle, build_bundle, make_optimizer, resolve_dtype, validate_config


@dataclasses.dataclass(frozen=True, slots=True)
class PlainMLPConfig:
    """Sizes and training settings of the plain-JAX classifier.

    Attributes:
      batch: examples per step.
      in_dim: input features.
      hidden: hidden width.
      classes: output classes.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
    """

    batch: int
    in_dim: int
    hidden: int
    classes: int
    learning_rate: float = 1e-2
    weight_decay: float = 0.01
    dtype: str = "float32"

    def __post_init__(self) -> None:
        validate_config(self)


def init_params(config: PlainMLPConfig, key: jax.Array) -> dict:
    """{"hidden": {"w", "b"}, "out": {"w", "b": None}}: LeCun-normal weights, zero bias."""
    k_hidden, k_out = jax.random.split(key)
    return {
        "hidden": {
            "w": jax.random.normal(k_hidden, (config.in_dim, config.hidden)) / math.sqrt(config.in_dim),
            "b": jnp.zeros((config.hidden,), jnp.float32),
        },
        "out": {
            "w": jax.random.normal(k_out, (config.hidden, config.classes)) / math.sqrt(config.hidden),
            "b": None,
        },
    }


def forward(params: dict, x: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Logits f32[batch, classes], computed in `dtype` from float32 params; a None bias is skipped."""
    cast = lambda a: a.astype(dtype)  # noqa: E731
    h = jnp.tanh(cast(x) @ cast(params["hidden"]["w"]) + cast(params["hidden"]["b"]))
    logits = h @ cast(params["out"]["w"])
    if params["out"]["b"] is not None:
        logits = logits + cast(params["out"]["b"])
    return logits.astype(jnp.float32)


def build(name: str, config: PlainMLPConfig) -> ModelBundle:
    """Builds the bundle: batch {"x": f32[B, in_dim], "labels": int32[B]}, mean cross entropy."""

    def make_batch(key: jax.Array):
        k_x, k_labels = jax.random.split(key)
        return {
            "x": jax.random.normal(k_x, (config.batch, config.in_dim), jnp.float32),
            "labels": jax.random.randint(k_labels, (config.batch,), 0, config.classes, jnp.int32),
        }

    def loss_fn(params, batch) -> jax.Array:
        log_probs = jax.nn.log_softmax(forward(params, batch["x"], resolve_dtype(config.dtype)), axis=-1)
        picked = jnp.take_along_axis(log_probs, batch["labels"][:, None], axis=-1)
        return -jnp.mean(picked)

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(
        name, config, lambda key: init_params(config, key), make_batch, loss_fn, optimizer
    )
