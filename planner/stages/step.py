"""The plain train step of a loss function and an optimizer, marked for the pipeline runtime.

The pipeline runtime re-assembles a step from its two halves (the loss for the forward and
backward programs, the optimizer for the update), so a step that should run pipelined carries
them as attributes. The zoo builds its steps here too: one definition of the plain step.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

TrainStep = Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]]


def pipelinable(loss_fn: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation) -> TrainStep:
    """The train step `(state, batch) -> (state, {"loss"})` of `loss_fn` and `optimizer`, marked so
    that a pipelined plan can run it (see `planner.emit.pipeline.runtime`).

    Traced or called directly it is the ordinary step: value_and_grad, then one optimizer update.

    Args:
      loss_fn: (params, batch) -> scalar loss.
      optimizer: the optax transformation whose state lives in state["opt_state"].

    Returns:
      A non-jitted function (state, batch) -> (new_state, {"loss": loss}) that jax.jit and
      jax.make_jaxpr accept, with `.loss_fn` and `.optimizer` attributes.
    """

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {"loss": loss}

    train_step.loss_fn = loss_fn
    train_step.optimizer = optimizer
    return train_step
