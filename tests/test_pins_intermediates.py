"""Pins on named intermediates (`jax.ad_checkpoint.checkpoint_name` values; planner/configs/pins.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import planner
from tests.helpers import assert_sgd_step_close

LR = 0.1


def _loss(params, batch):
    with jax.named_scope("layer"):
        h = checkpoint_name(jnp.tanh(batch["x"] @ params["w1"]), "hidden")
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _step(params, batch):
    loss, g = jax.value_and_grad(_loss)(params, batch)
    return optax.apply_updates(params, jax.tree.map(lambda x: -LR * x, g)), loss


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) * 0.3, "w2": jax.random.normal(k2, (32, 8)) * 0.3}
    return params, {"x": jax.random.normal(k3, (32, 16)), "y": jnp.zeros((32, 8))}


def _named_specs(f, args):
    plan, graph = f.plan(*args), f.graph(*args)
    named = {op.index for op in graph.ops if op.params.get("checkpoint_name") == "hidden"}
    return [spec for op, k, spec in plan.op_specs if op in named]


def test_pin_on_a_checkpoint_name_constrains_that_value_and_runs_equal(devices8):
    """`hidden` (its module path `layer/hidden`) pinned two ways: the ILP keeps the value as pinned
    (the free plan chooses another layout) and the step equals the unsharded one."""
    params, batch = _args()
    free = _named_specs(planner.plan_parallel(_step, mesh="2x4"), (params, batch))
    for pattern, pspec, spec in (("hidden", P(None, "y"), ((), (1,))), ("layer/hidden", P("x", None), ((0,), ()))):
        f = planner.plan_parallel(_step, mesh="2x4", pins={pattern: pspec})
        assert _named_specs(f, (params, batch)) == [spec] != free
        new_params, _ = f(params, batch)
        assert_sgd_step_close(_loss, LR, params, batch, new_params)


@pytest.mark.parametrize("pins, message", [
    ({"nothere": P()}, r"pin 'nothere' matches no argument path .* nor checkpoint_name intermediate"),
    ({"hidden": P(None, "z")}, r"pin 'hidden' on layer/hidden \(shape \(32, 32\)\): spec P\(None, z\) names mesh "
                               r"axis 'z'"),
])
def test_bad_intermediate_pins_are_one_line_errors(pins, message):
    with pytest.raises(planner.InvalidArgumentError, match=message) as e:
        planner.plan(_step, *_args(), mesh="2x4", pins=pins)
    assert "\n" not in str(e.value)
