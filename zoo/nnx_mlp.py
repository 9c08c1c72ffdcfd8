"""An MLP written with flax.nnx, trained through `nnx.split`: the style of a current flax user.

nnx modules are stateful Python objects; the planner needs a pure function of array pytrees. As the
nnx docs prescribe for jax transforms, the module is split once into a static graphdef (closed over
by the loss) and an `nnx.State` of Param variables, which is the params pytree in the train state;
the loss rebuilds the module with `nnx.merge` inside the traced function.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.train import ModelBundle, build_bundle, make_optimizer, resolve_dtype, validate_config


@dataclasses.dataclass(frozen=True, slots=True)
class NNXMLPConfig:
    """Sizes and training settings of the nnx MLP.

    Attributes:
      batch: examples per step.
      in_dim: input features.
      hidden: hidden width.
      out_dim: output features (regression target width).
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
    """

    batch: int
    in_dim: int
    hidden: int
    out_dim: int
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    dtype: str = "float32"

    def __post_init__(self) -> None:
        validate_config(self)


class NNXMLP(nnx.Module):
    """Linear -> LayerNorm -> GELU -> Linear."""

    def __init__(self, config: NNXMLPConfig, rngs: nnx.Rngs):
        dtype = resolve_dtype(config.dtype)
        self.fc_in = nnx.Linear(config.in_dim, config.hidden, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(config.hidden, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc_out = nnx.Linear(config.hidden, config.out_dim, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.norm(self.fc_in(x)))).astype(jnp.float32)


def build(name: str, config: NNXMLPConfig) -> ModelBundle:
    """Builds the bundle: params an nnx.State, batch {"x": f32[B, in], "y": f32[B, out]}, MSE loss."""
    # The graphdef is structure only; take it from an abstract module so nothing is allocated.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: NNXMLP(config, nnx.Rngs(0))))

    def init_params(key: jax.Array) -> nnx.State:
        _, state = nnx.split(NNXMLP(config, nnx.Rngs(params=key)))
        return state

    def make_batch(key: jax.Array):
        k_x, k_y = jax.random.split(key)
        return {
            "x": jax.random.normal(k_x, (config.batch, config.in_dim), jnp.float32),
            "y": jax.random.normal(k_y, (config.batch, config.out_dim), jnp.float32),
        }

    def loss_fn(params: nnx.State, batch) -> jax.Array:
        model = nnx.merge(graphdef, params)
        return jnp.mean(jnp.square(model(batch["x"]) - batch["y"]))

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_bundle(name, config, init_params, make_batch, loss_fn, optimizer)
