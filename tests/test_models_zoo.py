"""Model-specific tests of the zoo: Llama scanning and GQA, MoE routing, ResNet batch statistics,
BERT masking, the plain-JAX and nnx styles, and the parameter counts of the large shapes."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jcore

from zoo import get_model
from zoo.moe import top2_routing
from zoo.nnx_mlp import NNXMLP

# Each tiny model's jaxpr must contain these: they are what the planner needs rules for.
SIGNATURE_PRIMITIVES = {
    "llama-tiny": {"scan", "split", "sin", "cos", "logistic", "rsqrt"},
    "moe-tiny": {"argmax", "cumsum", "dot_general"},
    "wresnet-tiny": {
        "conv_general_dilated", "reduce_window_max", "reduce_window_sum", "select_and_scatter_add",
    },
    "bert-tiny": {"dot_general", "gather", "scatter-add"},
    "plain-mlp-tiny": {"gather", "tanh"},
    "nnx-mlp-tiny": {"rsqrt", "dot_general"},
}

# name -> (expected parameter count, relative tolerance): published sizes of these architectures.
PARAM_COUNTS = {
    "llama-7b": (6.74e9, 0.02),
    "llama-70b": (69e9, 0.05),
    "gshard-moe-1.3b": (1.3e9, 0.05),
    "wresnet-50-2": (68.9e6, 0.02),
    "bert-base": (110e6, 0.05),
    "bert-large": (340e6, 0.05),
}


def _compile(fn, *args):
    """jit + compile at XLA's lowest backend optimisation level, 2-3x faster to build on CPU."""
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})


def _param_count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _primitives(jaxpr: jcore.Jaxpr, found: set[str] | None = None) -> set[str]:
    """Names of every primitive in `jaxpr`, recursing into sub-jaxprs (scan bodies, jit, remat)."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    _primitives(sub.jaxpr, found)
                elif isinstance(sub, jcore.Jaxpr):
                    _primitives(sub, found)
    return found


def _jaxpr(name: str, **overrides) -> jcore.ClosedJaxpr:
    bundle = get_model(name, **overrides)
    return jax.make_jaxpr(bundle.train_step)(bundle.abstract_state(), bundle.abstract_batch())


@pytest.mark.parametrize("name", sorted(SIGNATURE_PRIMITIVES))
def test_train_step_jaxpr_has_signature_primitives(name: str) -> None:
    found = _primitives(_jaxpr(name).jaxpr)
    assert SIGNATURE_PRIMITIVES[name] <= found, SIGNATURE_PRIMITIVES[name] - found


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_large_shapes_param_counts_without_allocation(name: str) -> None:
    abs_state = get_model(name).abstract_state()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abs_state))
    expected, tolerance = PARAM_COUNTS[name]
    count = _param_count(abs_state["params"])
    assert abs(count - expected) / expected < tolerance, count


# --- Llama -----------------------------------------------------------------------------------


def test_llama_70b_stacks_layers_and_groups_kv_heads() -> None:
    params = get_model("llama-70b").abstract_state()["params"]
    attn = params["layers"]["attn"]
    assert attn["query"]["kernel"].shape == (80, 8192, 64, 128)
    assert attn["key"]["kernel"].shape == (80, 8192, 8, 128)
    assert params["layers"]["mlp"]["gate"]["kernel"].shape == (80, 8192, 28672)
    assert params["embed"]["embedding"].shape == params["lm_head"]["kernel"].shape[::-1]


def test_llama_scanned_jaxpr_size_does_not_grow_with_layers() -> None:
    small = _jaxpr("llama-tiny", layers=2).jaxpr
    deep = _jaxpr("llama-tiny", layers=48).jaxpr
    assert len(deep.eqns) == len(small.eqns)
    assert "scan" in {e.primitive.name for e in deep.eqns}
    unrolled = _jaxpr("llama-tiny", layers=2, scan_layers=False).jaxpr
    assert "scan" not in _primitives(unrolled)


def test_llama_remat_puts_a_checkpoint_in_the_scan() -> None:
    jaxpr = _jaxpr("llama-tiny", remat=True).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 2  # forward and backward
    remat_names = {"checkpoint", "remat2"}  # jax.checkpoint's primitive is "remat2" in JAX 0.10
    assert any(remat_names & _primitives(e.params["jaxpr"].jaxpr) for e in scans)
    assert not remat_names & _primitives(_jaxpr("llama-tiny").jaxpr)


def test_llama_scanned_equals_unrolled() -> None:
    """The same weights give the same loss whether the layers are scanned or a Python loop."""
    scanned = get_model("llama-tiny")
    unrolled = get_model("llama-tiny", scan_layers=False)
    params = scanned.init_state(jax.random.key(0))["params"]
    batch = scanned.make_batch(jax.random.key(1))
    per_layer = {k: v for k, v in params.items() if k != "layers"}
    for i in range(scanned.config.layers):
        per_layer[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
    assert jax.tree.structure(per_layer) == jax.tree.structure(unrolled.abstract_state()["params"])
    loss = _compile(scanned.loss_fn, params, batch)(params, batch)
    loss_unrolled = _compile(unrolled.loss_fn, per_layer, batch)(per_layer, batch)
    np.testing.assert_allclose(loss_unrolled, loss, rtol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [({"kv_heads": 3}, "heads=4.*kv_heads=3"), ({"heads": 64}, "head_dim=1")],
)
def test_llama_bad_heads(overrides: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        get_model("llama-tiny", **overrides)


# --- MoE -------------------------------------------------------------------------------------


def test_top2_routing_respects_capacity() -> None:
    logits = jax.random.normal(jax.random.key(0), (3, 16, 4))
    capacity = 5
    dispatch, combine, aux_loss = jax.jit(top2_routing, static_argnums=1)(logits, capacity)
    dispatch, combine = np.asarray(dispatch), np.asarray(combine)
    assert dispatch.shape == combine.shape == (3, 16, 4, capacity)
    assert dispatch.dtype == jnp.bool_
    assert dispatch.sum(axis=1).max() == 1  # one token per (group, expert, slot)
    assert dispatch.sum(axis=(2, 3)).max() == 2  # at most top-2 slots per token
    assert dispatch.sum(axis=(1, 3)).max() == capacity
    weights = combine.sum(axis=(2, 3))
    kept_both = dispatch.sum(axis=(2, 3)) == 2
    np.testing.assert_allclose(weights[kept_both], 1.0, rtol=1e-5)
    assert np.isfinite(float(aux_loss))


def test_top2_routing_drops_overflow_and_balances_loss() -> None:
    # Every token prefers expert 0, then expert 1: only `capacity` of them fit in each.
    route = jax.jit(top2_routing, static_argnums=1)
    logits = np.broadcast_to(np.array([3.0, 2.0, 0.0, 0.0], np.float32), (2, 8, 4))
    dispatch, _, aux_loss = route(logits, 3)
    dispatch = np.asarray(dispatch)
    assert dispatch[0, :, 0].sum() == 3 and dispatch[0, :, 1].sum() == 3
    assert not dispatch[0, 3:, 0].any()  # first come, first served
    # A collapsed router scores E * (mean gate of its expert); a uniform router scores 1.
    gate0 = np.exp(3.0) / (np.exp(3.0) + np.exp(2.0) + 2.0)
    np.testing.assert_allclose(aux_loss, 4 * gate0, rtol=1e-5)
    _, _, uniform = route(np.zeros((2, 8, 4), np.float32), 3)
    np.testing.assert_allclose(uniform, 1.0, rtol=1e-6)


def test_moe_layout_and_large_expert_shape() -> None:
    params = get_model("moe-tiny").abstract_state()["params"]
    assert "mlp" in params["blocks_0"] and "moe" in params["blocks_1"]  # every other layer
    assert params["blocks_1"]["moe"]["wi"].shape == (4, 64, 128)
    assert params["blocks_1"]["moe"]["wo"].shape == (4, 128, 64)
    large = get_model("moe-large-experts")
    big = large.abstract_state()["params"]
    experts = sum(_param_count(big[b]["moe"]) for b in big if b.startswith("blocks_"))
    assert experts / _param_count(big) > 0.9
    assert large.config.batch * large.config.seq >= 4096


def test_moe_aux_loss_is_in_the_loss() -> None:
    one_moe_layer = {"layers": 1, "moe_every": 1}
    bundle = get_model("moe-tiny", **one_moe_layer)
    heavy = get_model("moe-tiny", aux_loss_weight=10.0, **one_moe_layer)
    params = bundle.init_state(jax.random.key(0))["params"]
    batch = bundle.make_batch(jax.random.key(1))

    def both(p, b):
        return bundle.loss_fn(p, b), heavy.loss_fn(p, b)

    loss, loss_heavy = _compile(both, params, batch)(params, batch)
    # Near init the router is almost uniform and its aux loss about 1 (one MoE layer), so
    # raising the weight from 0.01 to 10 adds about 10.
    assert 5.0 < float(loss_heavy) - float(loss) < 20.0


def test_moe_group_size_must_divide_tokens() -> None:
    with pytest.raises(ValueError, match="group_size=48"):
        get_model("moe-tiny", group_size=48)


# --- Wide-ResNet -----------------------------------------------------------------------------


def test_resnet_state_layout() -> None:
    """The step's update of batch_stats is checked by test_models' training test; here the layout."""
    bundle = get_model("wresnet-tiny")
    state, batch = bundle.abstract_state(), bundle.abstract_batch()
    assert set(state) == {"params", "batch_stats", "opt_state"}
    assert batch["labels"].dtype == jnp.int32 and batch["images"].shape == (8, 32, 32, 3)
    assert jax.tree.structure(state["batch_stats"]["bn_init"]) == jax.tree.structure(
        {"mean": 0, "var": 0}
    )
    new_state, metrics = jax.eval_shape(bundle.train_step, state, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert jax.eval_shape(bundle.loss_fn, state["params"], batch).shape == ()


def test_resnet_50_2_shapes() -> None:
    state = get_model("wresnet-50-2").abstract_state()
    params = state["params"]
    assert params["conv_init"]["kernel"].shape == (7, 7, 3, 64)
    # Wide: the inner 3x3 conv of the last stage has 2 * 512 channels, the output 4 * 512.
    assert params["stage3_block2"]["Conv_1"]["kernel"].shape == (3, 3, 1024, 1024)
    assert params["stage3_block2"]["Conv_2"]["kernel"].shape == (1, 1, 1024, 2048)
    assert params["head"]["kernel"].shape == (2048, 1000)
    assert state["batch_stats"]["stage3_block2"]["BatchNorm_2"]["mean"].shape == (2048,)


# --- BERT ------------------------------------------------------------------------------------


def test_bert_masked_lm_loss_and_bidirectional_attention() -> None:
    bundle = get_model("bert-tiny", layers=1)
    params = bundle.init_state(jax.random.key(0))["params"]
    batch = {k: np.asarray(v) for k, v in bundle.make_batch(jax.random.key(1)).items()}
    mask = batch["mask"].astype(bool)
    assert batch["mask"].dtype == np.float32 and 0 < mask.mean() < 0.5
    assert (batch["inputs"][mask] == bundle.config.vocab - 1).all()  # [MASK]
    assert (batch["inputs"][~mask] == batch["targets"][~mask]).all()
    assert "lm_head" not in params and params["mlm_bias"].shape == (256,)  # tied decoder
    loss = _compile(bundle.loss_fn, params, batch)
    base = float(loss(params, batch))
    # Targets at unmasked positions do not count.
    unmasked_changed = dict(batch, targets=np.where(mask, batch["targets"], 0))
    np.testing.assert_allclose(float(loss(params, unmasked_changed)), base, rtol=1e-6)
    # Attention is bidirectional: a later token changes predictions at earlier masked positions.
    first_half = dict(batch, mask=batch["mask"] * (np.arange(32) < 16))
    last_changed = dict(first_half, inputs=first_half["inputs"].copy())
    last_changed["inputs"][:, -1] = 7
    assert abs(float(loss(params, last_changed)) - float(loss(params, first_half))) > 1e-6


# --- Other styles: plain JAX and flax.nnx ----------------------------------------------------


def test_plain_jax_keeps_none_leaf_and_int_labels() -> None:
    bundle = get_model("plain-mlp-tiny")
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    assert state["params"]["out"]["b"] is None
    assert batch["labels"].dtype == jnp.int32
    new_state, _ = jax.eval_shape(bundle.train_step, state, batch)
    assert new_state["params"]["out"]["b"] is None
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert jax.tree.structure(bundle.abstract_state()) == jax.tree.structure(state)


def test_nnx_state_round_trips_through_the_train_step() -> None:
    bundle = get_model("nnx-mlp-tiny")
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    assert isinstance(state["params"], nnx.State)
    new_state, _ = jax.eval_shape(bundle.train_step, state, batch)
    assert isinstance(new_state["params"], nnx.State)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    (kernel,) = jax.tree.leaves(new_state["params"]["fc_in"]["kernel"])
    assert kernel.shape == (16, 32)
    # The state merges back into a module, as an nnx user would do after training.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: NNXMLP(bundle.config, nnx.Rngs(0))))
    out = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), new_state["params"], batch["x"])
    assert out.shape == (32, 8)


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny", "llama-tiny", "moe-tiny"])
def test_heads_must_divide_d_model(name):
    with pytest.raises(ValueError, match=r"d_model=64 is not divisible by heads=3"):
        get_model(name, heads=3)
