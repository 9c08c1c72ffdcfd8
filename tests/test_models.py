"""Tests of the model zoo: the bundles train, their abstract shapes are exact, bad names fail clearly."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from planner.models import GPTConfig, ModelBundle, get_model, model_names

TINY = ("mlp-tiny", "mlp-wide", "mlp-tall", "gpt-tiny", "gpt-small-test")


def _shapes(tree) -> list[tuple[str, tuple[int, ...], jnp.dtype]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype)) for p, x in leaves]


def _param_count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains(name: str) -> None:
    bundle = get_model(name)
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    step = jax.jit(bundle.train_step)
    _, first = step(state, batch)
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert float(first["loss"]) == losses[0], "train_step must be deterministic"
    assert set(state) == {"params", "opt_state"}


@pytest.mark.parametrize("name", TINY)
def test_abstract_matches_concrete(name: str) -> None:
    bundle = get_model(name)
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    abs_state = bundle.abstract_state()
    abs_batch = bundle.abstract_batch()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abs_state))
    assert _shapes(abs_state) == _shapes(state)
    assert _shapes(abs_batch) == _shapes(batch)


def test_batch_layouts() -> None:
    gpt = get_model("gpt-tiny", batch=2, seq=16).abstract_batch()
    assert _shapes(gpt) == [
        ("['inputs']", (2, 16), jnp.dtype(jnp.int32)),
        ("['targets']", (2, 16), jnp.dtype(jnp.int32)),
    ]
    mlp = get_model("mlp-tiny").abstract_batch()
    assert _shapes(mlp) == [
        ("['x']", (64, 32), jnp.dtype(jnp.float32)),
        ("['y']", (64, 32), jnp.dtype(jnp.float32)),
    ]


def test_train_step_traces_with_layer_names() -> None:
    bundle = get_model("gpt-tiny")
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    jaxpr = jax.make_jaxpr(bundle.train_step)(state, batch)
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.jaxpr.eqns}
    assert any("blocks_0" in s for s in stacks) and any("blocks_1" in s for s in stacks)


def test_gpt_layer_names_and_tied_head() -> None:
    params = get_model("gpt-tiny").abstract_state()["params"]
    assert [k for k in params if k.startswith("blocks_")] == ["blocks_0", "blocks_1"]
    assert "lm_head" in params
    tied = get_model("gpt-tiny", tie_embeddings=True).abstract_state()["params"]
    assert "lm_head" not in tied
    assert _param_count(params) - _param_count(tied) == 256 * 64


def test_bfloat16_activations_keep_float32_params() -> None:
    bundle = get_model("gpt-tiny", dtype="bfloat16", layers=1)
    state = bundle.init_state(jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
    _, metrics = jax.jit(bundle.train_step)(state, bundle.make_batch(jax.random.key(1)))
    assert np.isfinite(float(metrics["loss"]))


def test_gpt3_39b_param_count_without_allocation() -> None:
    abs_state = get_model("gpt3-39b").abstract_state()
    count = _param_count(abs_state["params"])
    assert abs(count - 39e9) / 39e9 < 0.05, count
    # AdamW keeps two moments per parameter.
    assert _param_count(abs_state["opt_state"]) >= 2 * count


def test_all_registered_configs_are_valid() -> None:
    names = model_names()
    assert set(TINY) <= set(names)
    assert "gpt3-39b" in names and len(names) == len(set(names))
    for name in names:
        bundle = get_model(name)
        assert isinstance(bundle, ModelBundle) and bundle.name == name
        with pytest.raises(dataclasses.FrozenInstanceError):
            bundle.config.batch = 1  # type: ignore[misc]


def test_overrides_apply() -> None:
    bundle = get_model("gpt-tiny", batch=4, seq=8, layers=1)
    assert bundle.config == GPTConfig(batch=4, seq=8, vocab=256, d_model=64, heads=4, layers=1)


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ValueError, match=r"'gpt-huge'.*gpt-tiny"):
        get_model("gpt-huge")


def test_unknown_override_is_named() -> None:
    with pytest.raises(TypeError, match=r"num_layers.*layers"):
        get_model("gpt-tiny", num_layers=3)


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({"batch": 0}, ValueError, "batch=0"),
        ({"batch": 2.5}, TypeError, "batch=2.5"),
        ({"heads": 3}, ValueError, "d_model=64.*heads=3"),
        ({"dtype": "float16"}, ValueError, "'float16'"),
    ],
)
def test_bad_override_values(overrides: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        get_model("gpt-tiny", **overrides)
