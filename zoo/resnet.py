"""A Wide-ResNet image classifier: convolutions, batch norm with running statistics, pooling.

The model Alpa and others plan as the convolutional benchmark. Its train state carries batch norm's
running mean and variance beside the params, state = {"params", "batch_stats", "opt_state"}; the
train step uses batch statistics (training mode) and returns the updated running averages.
Pooling is nn.max_pool / nn.avg_pool, i.e. `reduce_window` in the jaxpr (and `select_and_scatter_add`
/ `pad` in its gradient).
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from zoo.train import (
    ModelBundle,
    build_stateful_bundle,
    make_optimizer,
    resolve_dtype,
    validate_config,
)

_COLLECTIONS = ("batch_stats",)


@dataclasses.dataclass(frozen=True, slots=True)
class ResNetConfig:
    """Sizes and training settings of a (Wide-)ResNet.

    Attributes:
      batch: images per step.
      image_size: height and width of the square input images.
      channels: input channels (3 for RGB).
      num_classes: classification classes.
      stage_sizes: residual blocks per stage; stage i has base_width * 2**i channels and, after the
        first, halves the spatial size.
      base_width: channels of the first stage (64 in ResNet-50).
      width_factor: widening of each block's inner convolutions (2 for Wide-ResNet-50-2).
      bottleneck: 1x1-3x3-1x1 bottleneck blocks with 4x expansion (ResNet-50 style) instead of
        two 3x3 convolutions (ResNet-18 style).
      imagenet_stem: 7x7/2 convolution stem (ImageNet); otherwise a 3x3/1 stem for small images.
      dtype: compute dtype name ("float32", "bfloat16" or "float16"); parameters stay float32.
      learning_rate: AdamW learning rate.
      weight_decay: AdamW weight decay.
    """

    batch: int
    image_size: int
    channels: int
    num_classes: int
    stage_sizes: tuple[int, ...]
    base_width: int = 64
    width_factor: int = 2
    bottleneck: bool = True
    imagenet_stem: bool = True
    dtype: str = "float32"
    learning_rate: float = 1e-3
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        validate_config(self)
        if (
            not isinstance(self.stage_sizes, tuple)
            or not self.stage_sizes
            or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in self.stage_sizes)
        ):
            raise ValueError(
                f"ResNetConfig.stage_sizes={self.stage_sizes!r} must be a non-empty tuple of "
                "positive ints, e.g. (3, 4, 6, 3)"
            )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; a 1x1 projection when the shape changes."""

    filters: int
    inner: int
    strides: int
    conv: functools.partial
    norm: functools.partial

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm()(self.conv(self.inner, (3, 3), (self.strides, self.strides))(x)))
        y = self.norm(scale_init=nn.initializers.zeros)(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(
                self.conv(self.filters, (1, 1), (self.strides, self.strides), name="conv_proj")(x)
            )
        return nn.relu(x + y)


class BottleneckBlock(nn.Module):
    """1x1 (inner) -> 3x3 (inner, strided) -> 1x1 (4 * filters), each with batch norm."""

    filters: int
    inner: int
    strides: int
    conv: functools.partial
    norm: functools.partial

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm()(self.conv(self.inner, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.inner, (3, 3), (self.strides, self.strides))(y)))
        y = self.norm(scale_init=nn.initializers.zeros)(self.conv(4 * self.filters, (1, 1))(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(
                self.conv(4 * self.filters, (1, 1), (self.strides, self.strides), name="conv_proj")(x)
            )
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem conv + BN + ReLU + 3x3/2 max pool, residual stages, global average pool, Dense head."""

    config: ResNetConfig

    @nn.compact
    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        cfg = self.config
        dtype = resolve_dtype(cfg.dtype)
        conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype, param_dtype=jnp.float32)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=dtype,
            param_dtype=jnp.float32,
        )
        x = images.astype(dtype)
        if cfg.imagenet_stem:
            x = conv(cfg.base_width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        else:
            x = conv(cfg.base_width, (3, 3), name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block_cls = BottleneckBlock if cfg.bottleneck else BasicBlock
        for i, size in enumerate(cfg.stage_sizes):
            filters = cfg.base_width * 2**i
            for j in range(size):
                x = block_cls(
                    filters=filters,
                    inner=filters * cfg.width_factor,
                    strides=2 if i > 0 and j == 0 else 1,
                    conv=conv,
                    norm=norm,
                    name=f"stage{i}_block{j}",
                )(x)
        x = nn.avg_pool(x, x.shape[1:3])  # global average pooling as a reduce_window
        x = x.reshape(x.shape[0], -1)
        logits = nn.Dense(cfg.num_classes, dtype=dtype, param_dtype=jnp.float32, name="head")(x)
        return logits.astype(jnp.float32)


def build(name: str, config: ResNetConfig) -> ModelBundle:
    """Builds the ResNet bundle: batch {"images": f32[B, H, W, C], "labels": int32[B]}, mean cross
    entropy; state {"params", "batch_stats", "opt_state"}."""
    model = ResNet(config)
    shape = (config.image_size, config.image_size, config.channels)

    def init_variables(key: jax.Array):
        return dict(model.init(key, jnp.zeros((1, *shape), jnp.float32), train=False))

    def make_batch(key: jax.Array):
        k_images, k_labels = jax.random.split(key)
        return {
            "images": jax.random.normal(k_images, (config.batch, *shape), jnp.float32),
            "labels": jax.random.randint(k_labels, (config.batch,), 0, config.num_classes, jnp.int32),
        }

    def loss_fn(params, model_state, batch):
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["images"], train=True, mutable=list(_COLLECTIONS)
        )
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))
        return loss, dict(updates)

    optimizer = make_optimizer(config.learning_rate, config.weight_decay)
    return build_stateful_bundle(
        name, config, init_variables, make_batch, loss_fn, optimizer, _COLLECTIONS
    )
