"""The one place where a loss function and an optimizer become a train step and a ModelBundle.

Every model in the zoo shares this code so that the planner sees the same program shape
(value_and_grad of the loss, then an optax AdamW update) whatever the network is.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

Params = Any
Batch = Any
State = dict[str, Any]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Params, Batch], jax.Array]
TrainStep = Callable[[State, Batch], tuple[State, Metrics]]

DTYPES: Mapping[str, Any] = types.MappingProxyType(
    {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
)


def resolve_dtype(name: str) -> Any:
    """Maps a config dtype name to the jnp dtype; configs store names so they stay hashable and JSON-able."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelBundle:
    """A model as the planner consumes it: a train step plus the means to build its arguments.

    Attributes:
      name: registry name, e.g. "gpt-tiny".
      config: the frozen size config the bundle was built from.
      init_state: key -> {"params": ..., "opt_state": ...} with concrete arrays.
      make_batch: key -> batch pytree of concrete arrays.
      abstract_state: () -> init_state's pytree as jax.ShapeDtypeStruct (nothing allocated).
      abstract_batch: () -> make_batch's pytree as jax.ShapeDtypeStruct.
      train_step: (state, batch) -> (new_state, {"loss": scalar}); plain Python, not jitted.
      loss_fn: (params, batch) -> scalar loss, for callers that want the forward pass only.
    """

    name: str
    config: Any
    init_state: Callable[[jax.Array], State]
    make_batch: Callable[[jax.Array], Batch]
    abstract_state: Callable[[], State]
    abstract_batch: Callable[[], Batch]
    train_step: TrainStep
    loss_fn: LossFn


def make_optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """AdamW, the optimizer whose state (two moments per parameter) the planner must place."""
    return optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation) -> TrainStep:
    """Builds the pure train step: value_and_grad of `loss_fn`, then one optimizer update.

    Args:
      loss_fn: (params, batch) -> scalar loss.
      optimizer: the optax transformation whose state lives in state["opt_state"].

    Returns:
      A non-jitted function (state, batch) -> (new_state, {"loss": loss}) that jax.jit and
      jax.make_jaxpr accept.
    """

    def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    return train_step


def build_bundle(
    name: str,
    config: Any,
    init_params: Callable[[jax.Array], Params],
    make_batch: Callable[[jax.Array], Batch],
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
) -> ModelBundle:
    """Assembles a ModelBundle; abstract shapes come from jax.eval_shape so huge models cost nothing.

    Args:
      name: registry name of the model.
      config: its frozen config.
      init_params: key -> parameter pytree.
      make_batch: key -> batch pytree.
      loss_fn: (params, batch) -> scalar loss.
      optimizer: the optax transformation for the train step.

    Returns:
      The bundle; its train step and init share the same optimizer instance.
    """

    def init_state(key: jax.Array) -> State:
        params = init_params(key)
        return {"params": params, "opt_state": optimizer.init(params)}

    def abstract_state() -> State:
        return jax.eval_shape(init_state, jax.random.key(0))

    def abstract_batch() -> Batch:
        return jax.eval_shape(make_batch, jax.random.key(0))

    return ModelBundle(
        name=name,
        config=config,
        init_state=init_state,
        make_batch=make_batch,
        abstract_state=abstract_state,
        abstract_batch=abstract_batch,
        train_step=make_train_step(loss_fn, optimizer),
        loss_fn=loss_fn,
    )


def validate_config(config: Any) -> None:
    """Checks a size config's fields by their annotated type, so a bad override fails at get_model time.

    Int fields must be positive ints, float fields non-negative numbers, bool fields bools, and a
    `dtype` field one of DTYPES.

    Raises:
      TypeError: a field holds a value of the wrong type.
      ValueError: a field holds a value out of range.
    """
    cls = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{cls}.{field.name}={value!r} must be an int")
            if value <= 0:
                raise ValueError(f"{cls}.{field.name}={value} must be a positive int")
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{cls}.{field.name}={value!r} must be a number")
            if value < 0:
                raise ValueError(f"{cls}.{field.name}={value} must be >= 0")
        elif kind == "bool" and not isinstance(value, bool):
            raise TypeError(f"{cls}.{field.name}={value!r} must be True or False")
    if hasattr(config, "dtype"):
        resolve_dtype(config.dtype)
