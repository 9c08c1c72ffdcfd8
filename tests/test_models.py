"""Tests of the model zoo: the bundles train, their abstract shapes are exact, bad names fail clearly."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import GPTConfig, ModelBundle, get_model, model_names

# One worker runs the whole module, so its module-scoped fixtures are made once (`make test`: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("test_models")

TINY = (
    "mlp-tiny",
    "mlp-wide",
    "mlp-tall",
    "gpt-tiny",
    "gpt-small-test",
    "llama-tiny",
    "moe-tiny",
    "wresnet-tiny",
    "bert-tiny",
    "plain-mlp-tiny",
    "nnx-mlp-tiny",
)
# gpt-small-test is gpt-tiny's code at a size meant for planner tests; training it again here
# would only add compile time.
TRAINED = tuple(name for name in TINY if name != "gpt-small-test")
# Models whose train state carries non-trainable collections beside params and opt_state.
EXTRA_STATE = {"wresnet-tiny": {"batch_stats"}}


@pytest.fixture(scope="module")
def initialized():
    """name -> (bundle, state, batch), each built once per module (arrays are immutable)."""
    cache: dict[str, tuple[ModelBundle, dict, dict]] = {}

    def get(name: str):
        if name not in cache:
            bundle = get_model(name)
            state = bundle.init_state(jax.random.key(0))
            cache[name] = (bundle, state, bundle.make_batch(jax.random.key(1)))
        return cache[name]

    return get


def _compile(fn, *args):
    """jit + compile at XLA's lowest backend optimisation level: 2-3x faster to build on CPU, and
    these tests care that the step runs and learns, not how fast."""
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})


def _shapes(tree) -> list[tuple[str, tuple[int, ...], jnp.dtype]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype)) for p, x in leaves]


def _param_count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", TRAINED)
def test_tiny_model_trains(name: str, initialized) -> None:
    bundle, initial, batch = initialized(name)
    state = initial
    step = _compile(bundle.train_step, state, batch)
    _, first = step(state, batch)
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert float(first["loss"]) == losses[0], "train_step must be deterministic"
    assert set(state) == {"params", "opt_state"} | EXTRA_STATE.get(name, set())
    assert jax.tree.structure(state) == jax.tree.structure(initial)
    for collection in EXTRA_STATE.get(name, ()):
        # Non-trainable state (batch norm's running statistics) is threaded through the step.
        moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), state[collection], initial[collection])
        assert all(jax.tree.leaves(moved)), moved


@pytest.mark.parametrize("name", TINY)
def test_abstract_matches_concrete(name: str, initialized) -> None:
    bundle, state, batch = initialized(name)
    abs_state = bundle.abstract_state()
    abs_batch = bundle.abstract_batch()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abs_state))
    assert _shapes(abs_state) == _shapes(state)
    assert _shapes(abs_batch) == _shapes(batch)


@pytest.mark.parametrize("name", TINY)
def test_train_step_traces_abstractly(name: str) -> None:
    """The planner traces train steps with jax.make_jaxpr on abstract arguments; the new state
    must come back with the same structure, shapes and dtypes as the old one."""
    bundle = get_model(name)
    state = bundle.abstract_state()
    jaxpr, (new_state, metrics) = jax.make_jaxpr(bundle.train_step, return_shape=True)(
        state, bundle.abstract_batch()
    )
    assert jaxpr.jaxpr.eqns
    assert _shapes(new_state) == _shapes(state)
    assert metrics["loss"].shape == () and metrics["loss"].dtype == jnp.float32


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


def test_init_is_deterministic_and_accepts_raw_keys() -> None:
    bundle = get_model("mlp-tiny")
    a = bundle.init_state(jax.random.key(3))
    b = bundle.init_state(jax.random.key(3))
    raw = bundle.init_state(jax.random.PRNGKey(3))
    other = bundle.init_state(jax.random.key(4))
    leaf = lambda s: s["params"]["dense_0"]["kernel"]  # noqa: E731
    np.testing.assert_array_equal(leaf(a), leaf(b))
    assert _shapes(raw) == _shapes(a)
    assert not np.array_equal(leaf(a), leaf(other))


def test_train_step_traces_with_layer_names() -> None:
    bundle = get_model("gpt-tiny")
    jaxpr = jax.make_jaxpr(bundle.train_step)(bundle.abstract_state(), bundle.abstract_batch())
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
    batch = bundle.make_batch(jax.random.key(1))
    _, metrics = _compile(bundle.train_step, state, batch)(state, batch)
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
    assert {"gpt3-39b", "llama-70b", "gshard-moe-1.3b", "wresnet-50-2", "bert-large"} <= set(names)
    assert len(names) == len(set(names))
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
        ({"dtype": "int8"}, ValueError, "'int8'"),
    ],
)
def test_bad_override_values(overrides: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        get_model("gpt-tiny", **overrides)
