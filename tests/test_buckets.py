"""`plan_parallel(..., shapes="bucketed")`: a batch size in a planned bucket runs with the bucket's
plan, recompiled for its shapes (numerics as the unsharded step, the compiled program sharded as the
plan says); sizes the plan cannot split, and steps that branch on their batch size, are planned on
their own."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner.core.mesh import default_axis_names
from planner.planning.buckets import bucket
from tests.helpers import assert_sgd_step_close

LR = 0.1
AXIS = default_axis_names(1)[0]


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return jnp.mean((h - batch["y"]) ** 2)


def _step(params, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (16, 64)) / 4, "w2": jax.random.normal(k2, (64, 8)) / 8}


def _batch(n: int):
    k1, k2 = jax.random.split(jax.random.key(n))
    return {"x": jax.random.normal(k1, (n, 16)), "y": jax.random.normal(k2, (n, 8))}


def _batch_ways(plan) -> int:
    """How many ways the plan splits the batch's `x` rows (the last-but-one argument leaf)."""
    spec = plan.input_specs[-2]
    return int(np.prod([plan.mesh.shape[a] for a in spec[0]])) if spec[0] else 1


def test_buckets_are_powers_of_two_and_the_mode_is_checked():
    assert [bucket(n) for n in (1, 2, 3, 33, 64, 65)] == [1, 2, 4, 64, 64, 128]
    with pytest.raises(planner.InvalidArgumentError, match="shapes='ragged'"):
        planner.plan_parallel(_step, mesh=(8,), shapes="ragged")


def test_a_size_in_a_planned_bucket_reuses_its_plan(devices8, caplog):
    params = _params()
    # The batch pinned data parallel (on its own the planner splits this MLP's hidden units instead),
    # so that the bucket holds sizes the plan cannot split.
    step = planner.plan_parallel(_step, mesh=(8,), shapes="bucketed", pins={"1/x": P(AXIS), "1/y": P(AXIS)})
    planned = step.plan(params, _batch(64))
    ways = _batch_ways(planned)
    size = next(n for n in range(63, 32, -1) if n % ways == 0)
    batch = _batch(size)
    with caplog.at_level(logging.INFO, logger="planner"):
        new_params, loss = step(params, batch)
    assert "its plan reused" in caplog.text
    assert step.plan(params, batch) is planned
    assert_sgd_step_close(_loss, LR, params, batch, new_params)
    np.testing.assert_allclose(loss, _loss(params, batch), rtol=1e-5)
    # The compiled program at the new size takes the batch as the plan lays it out.
    compiled = step.lower(params, batch).compile()
    got = jax.tree.leaves(compiled.input_shardings[0])[-2]
    want = jax.tree.leaves(planned.in_shardings)[-2]
    assert got.is_equivalent_to(want, 2)
    assert ways == 8
    # A size the plan's batch split does not divide is planned on its own, where the pin cannot hold.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="planner"), pytest.raises(planner.InvalidArgumentError,
                                                                         match="size 33 over 8 devices"):
        step.plan(params, _batch(33))
    assert "planning this batch size on its own" in caplog.text and "splits a dimension of size 33" in caplog.text


def test_a_step_that_branches_on_its_batch_size_is_planned_per_size(devices8, caplog):
    def branching(params, batch):
        if batch["x"].shape[0] > 40:
            batch = {"x": 2 * batch["x"], "y": batch["y"]}
        return _step(params, batch)

    params = _params()
    step = planner.plan_parallel(branching, mesh=(8,), shapes="bucketed")
    planned = step.plan(params, _batch(64))
    with caplog.at_level(logging.INFO, logger="planner"):
        other = step.plan(params, _batch(40))
    assert "traces to another program" in caplog.text and other is not planned
