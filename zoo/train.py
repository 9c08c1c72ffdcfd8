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

from planner.stages.step import pipelinable

Params = Any
Batch = Any
State = dict[str, Any]
Metrics = dict[str, jax.Array]
LossFn = Callable[[Params, Batch], jax.Array]
ModelState = dict[str, Any]
StatefulLossFn = Callable[[Params, ModelState, Batch], tuple[jax.Array, ModelState]]
TrainStep = Callable[[State, Batch], tuple[State, Metrics]]

# Init and batch creation are jitted (run eagerly, an init dispatches hundreds of tiny ops one by one)
# but run about once per model, so they are compiled for build speed, not run speed: on CPU the
# lowest backend optimisation level compiles 2-3x faster.
_RUN_ONCE_OPTIONS: Mapping[str, Any] = types.MappingProxyType({"xla_backend_optimization_level": 0})

# Compute dtypes a zoo model can train in: every config's `dtype` sets activations and matmul
# inputs, while parameters and the AdamW moments stay float32 (mixed precision as people train:
# bf16 on A100/H100/TPU, fp16 on V100, which has no bf16 tensor cores).
DTYPES: Mapping[str, Any] = types.MappingProxyType(
    {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
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
      init_state: key -> {"params": ..., "opt_state": ...} with concrete arrays (jitted; models with
        non-trainable state add entries, e.g. "batch_stats"). Any PRNG key type is accepted.
      make_batch: key -> batch pytree of concrete arrays (jitted).
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


def init_key(key: jax.Array) -> jax.Array:
    """Turns any PRNG key into the RBG-generator key that parameter initialisers draw from.

    XLA unrolls threefry's rounds at every call site, and a model draws once per parameter, so a
    threefry init of even a tiny ResNet compiles for seconds on CPU; RngBitGenerator is one op.
    Deterministic for a given key and backend (its bits may differ between backends).
    """
    return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl="rbg")


def make_optimizer(learning_rate: float, weight_decay: float) -> optax.GradientTransformation:
    """AdamW, the optimizer whose state (two moments per parameter) the planner must place."""
    return optax.adamw(learning_rate=learning_rate, weight_decay=weight_decay)


# The plain step is the core's (`planner.pipelinable`): zoo steps carry the markers the pipeline
# runtime needs, and there is one definition of value_and_grad-then-update.
make_train_step = pipelinable


def make_stateful_train_step(
    loss_fn: StatefulLossFn, optimizer: optax.GradientTransformation, collections: tuple[str, ...]
) -> TrainStep:
    """Like make_train_step, for models with non-trainable state updated by the forward pass.

    Batch norm's running statistics are the example: they live beside the params in the train
    state (state = {"params", "batch_stats", "opt_state"}), are not differentiated, and come back
    from the forward pass as a new value.

    Args:
      loss_fn: (params, {collection: tree}, batch) -> (scalar loss, {collection: new tree}).
      optimizer: the optax transformation whose state lives in state["opt_state"].
      collections: names of the state entries that loss_fn reads and returns, e.g. ("batch_stats",).

    Returns:
      A non-jitted function (state, batch) -> (new_state, {"loss": loss}).
    """

    def train_step(state: State, batch: Batch) -> tuple[State, Metrics]:
        model_state = {name: state[name] for name in collections}
        (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], model_state, batch
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {"params": params, "opt_state": opt_state}
        new_state.update({name: new_model_state[name] for name in collections})
        return new_state, {"loss": loss}

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

    return _assemble(
        name, config, init_state, make_batch, make_train_step(loss_fn, optimizer), loss_fn
    )


def build_stateful_bundle(
    name: str,
    config: Any,
    init_variables: Callable[[jax.Array], dict[str, Any]],
    make_batch: Callable[[jax.Array], Batch],
    loss_fn: StatefulLossFn,
    optimizer: optax.GradientTransformation,
    collections: tuple[str, ...],
) -> ModelBundle:
    """Assembles a ModelBundle whose state carries non-trainable collections beside the params.

    Args:
      name: registry name of the model.
      config: its frozen config.
      init_variables: key -> {"params": ..., collection: ...} (a flax variables dict).
      make_batch: key -> batch pytree.
      loss_fn: (params, {collection: tree}, batch) -> (scalar loss, {collection: new tree}).
      optimizer: the optax transformation for the train step.
      collections: the non-trainable collections, e.g. ("batch_stats",).

    Returns:
      The bundle; its state is {"params", *collections, "opt_state"} and its loss_fn is
      (params, batch) -> loss evaluated with zeroed collections (the training-mode loss of a
      batch-norm network does not depend on the running statistics).

    Raises:
      ValueError: a collection is named "params" or "opt_state".
    """
    clashes = sorted({"params", "opt_state"} & set(collections))
    if clashes:
        raise ValueError(f"collections {clashes} of {name!r} clash with the train state's own keys")

    def init_state(key: jax.Array) -> State:
        variables = init_variables(key)
        missing = sorted((set(collections) | {"params"}) - set(variables))
        if missing:
            raise ValueError(f"init_variables of {name!r} returned no {missing}")
        state = {c: variables[c] for c in collections}
        state.update(params=variables["params"], opt_state=optimizer.init(variables["params"]))
        return state

    def params_loss(params: Params, batch: Batch) -> jax.Array:
        shapes = jax.eval_shape(init_variables, jax.random.key(0))
        zeros = {c: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[c]) for c in collections}
        return loss_fn(params, zeros, batch)[0]

    train_step = make_stateful_train_step(loss_fn, optimizer, collections)
    return _assemble(name, config, init_state, make_batch, train_step, params_loss)


def _assemble(
    name: str,
    config: Any,
    init_state: Callable[[jax.Array], State],
    make_batch: Callable[[jax.Array], Batch],
    train_step: TrainStep,
    loss_fn: LossFn,
) -> ModelBundle:
    def init_from_any_key(key: jax.Array) -> State:
        return init_state(init_key(key))

    def abstract_state() -> State:
        return jax.eval_shape(init_from_any_key, jax.random.key(0))

    def abstract_batch() -> Batch:
        return jax.eval_shape(make_batch, jax.random.key(0))

    return ModelBundle(
        name=name,
        config=config,
        init_state=jax.jit(init_from_any_key, compiler_options=_RUN_ONCE_OPTIONS),
        make_batch=jax.jit(make_batch, compiler_options=_RUN_ONCE_OPTIONS),
        abstract_state=abstract_state,
        abstract_batch=abstract_batch,
        train_step=train_step,
        loss_fn=loss_fn,
    )


def validate_config(config: Any) -> None:
    """Checks a size config's fields by their annotated type, so a bad override fails at get_model time.

    Int fields must be positive ints, float fields non-negative numbers, bool fields bools, a
    `dtype` field one of DTYPES, and a transformer's `d_model` divisible by its `heads`.

    Raises:
      TypeError: a field holds a value of the wrong type.
      ValueError: a field holds a value out of range.
    """
    cls = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if kind == "int":
            if jax.export.is_symbolic_dim(value):  # a shape family's size symbol (`planner.graph.shape_family`)
                continue
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
    if hasattr(config, "heads") and hasattr(config, "d_model") and config.d_model % config.heads:
        raise ValueError(
            f"{cls}.d_model={config.d_model} is not divisible by heads={config.heads}; "
            "choose heads that divide d_model"
        )
