"""planner.graph.batch_mixing: which ops of a loss combine several examples (where microbatching changes
the result), and that the loss's own mean over examples is not one of them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from planner.graph.batch_mixing import mixing_ops
from planner.graph.trace import trace
from zoo import get_model

W = jnp.ones((8, 8)) / 8


def _mixing(loss_fn, batch, params=W):
    g = trace(loss_fn, params, batch)
    n = len(jax.tree.leaves(params))
    return [m.describe() for m in mixing_ops(g, g.inputs[n:], g.outputs[0])]


def _mse(h, y):
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


X = {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 8))}


def test_per_example_layers_and_a_mean_loss_mix_nothing():
    def loss(w, b):
        h = jnp.tanh(b["x"] @ w)
        h = jax.nn.softmax(h, axis=-1) * h.shape[-1]
        h = jax.vmap(lambda r: jax.lax.cond(r[0] > 0, jnp.sin, jnp.cos, r))(h)  # per example
        h = jax.lax.fori_loop(0, 3, lambda i, v: v * 0.9, h)
        return _mse(h, b["y"])

    assert _mixing(loss, X) == []


def test_a_statistic_over_the_batch_is_named():
    def batch_norm(w, b):
        h = b["x"] @ w
        with jax.named_scope("norm"):
            h = (h - jnp.mean(h, axis=0)) / jnp.sqrt(jnp.var(h, axis=0) + 1e-5)
        return _mse(h, b["y"])

    found = _mixing(batch_norm, X)
    assert found and all("norm" in f and "reduces over the batch dimension" in f for f in found), found


@pytest.mark.parametrize("kind", ["cond", "while", "gram", "token_weighted", "cumsum", "shift"])
def test_ops_that_read_other_examples_are_found(kind):
    def loss(w, b):
        h = jnp.tanh(b["x"] @ w)
        if kind == "cond":  # a predicate over the whole batch
            h = jax.lax.cond(jnp.abs(h).sum() < 0, lambda v: v * 2.0, lambda v: v - 1.0, h)
        elif kind == "while":  # a trip count read from every example
            h = jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 0.5, lambda v: v * 0.5, h)
        elif kind == "gram":  # examples against examples
            h = (h @ h.T) @ h / 16
        elif kind == "cumsum":
            h = jnp.cumsum(h, axis=0)
        elif kind == "shift":
            h = jnp.roll(h, 1, axis=0)
        if kind == "token_weighted":  # a mean over the batch's positions that count
            mask = (b["x"] > 0.5).astype(jnp.float32)
            return jnp.sum(h * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        return _mse(h, b["y"])

    assert _mixing(loss, X), kind


def test_a_trip_count_read_from_parameters_mixes_nothing():
    def loss(w, b):
        n = (jnp.abs(w[0, 0]) * 20).astype(jnp.int32)
        h = jax.lax.while_loop(lambda s: s[1] < n, lambda s: (s[0] * 0.9, s[1] + 1), (b["x"] @ w, 0))[0]
        return _mse(h, b["y"])

    assert _mixing(loss, X) == []


def test_attention_over_merged_batch_and_sequence_mixes_nothing():
    """Batch dims of a dot, a reshape merging batch and sequence, a mean over every token (each
    example has the same number): all per example."""
    def loss(w, b):
        x = b["x"].reshape(4, 4, 8)
        scores = jnp.einsum("bsd,btd->bst", x @ w, x)
        h = jnp.einsum("bst,btd->bsd", jax.nn.softmax(scores, axis=-1), x).reshape(16, 8)
        return jnp.mean((h - b["y"]) ** 2)

    assert _mixing(loss, {"x": jnp.ones((16, 8)), "y": jnp.zeros((16, 8))}) == []


def test_zoo_models():
    """BatchNorm (wresnet) mixes examples; the transformers' losses do not."""
    for name, mixes in (("wresnet-tiny", True), ("gpt-tiny", False), ("llama-tiny", False)):
        b = get_model(name)
        params = b.abstract_state()["params"]
        found = _mixing(b.loss_fn, b.abstract_batch(), params)
        assert bool(found) == mixes, (name, found[:3])


def test_gradient_accumulation_says_when_the_step_mixes_examples(caplog, devices8):
    """Its forward is analysed (the backward sums examples' gradients by design): a batch statistic
    is named once, a per-example loss is not."""
    import logging

    import optax

    import planner

    opt = optax.sgd(0.1)

    def make(normalise):
        def loss(w, b):
            h = b["x"] @ w
            if normalise:
                h = h - jnp.mean(h, axis=0)
            return _mse(h, b["y"])
        return planner.pipelinable(loss, opt)

    state = {"params": W, "opt_state": opt.init(W)}
    for normalise in (True, False):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="planner"):
            planner.plan(make(normalise), state, X, mesh="1x8", accumulate=2)
        said = [r.getMessage() for r in caplog.records if "microbatch-invariant" in r.getMessage()]
        assert (len(said) == 1 and "reduces over the batch dimension" in said[0]) if normalise else not said, said


def test_one_example_microbatches_are_read_at_two(caplog):
    """A pipeline of one-example microbatches: its trace's batch dimension has size 1, which
    `take_along_axis` reshapes away (gpt-tiny's loss picks each token's label), so the analysis reads
    the loss traced at two examples instead: no warning for gpt-tiny, still one for a batch
    statistic."""
    import logging

    import optax

    from planner.emit.pipeline.runtime import PipelinedStep, even_layouts, layer_names

    b = get_model("gpt-tiny", layers=2, batch=4, seq=8, d_model=32, vocab=64)
    params, batch = b.abstract_state()["params"], b.abstract_batch()

    def normalised(p, bt):  # scaled by a statistic of the whole batch's tokens
        return b.loss_fn(p, bt) / (1.0 + jnp.mean(bt["inputs"].astype(jnp.float32)))

    for loss, mixes in ((b.loss_fn, False), (normalised, True)):
        names = layer_names(loss, params, batch)
        step = PipelinedStep(loss, optax.sgd(0.1), even_layouts(names, jax.devices()[:2], 2), 4, "1f1b")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="planner"):
            step.stage_plan_records(params, batch)
        said = [r.getMessage() for r in caplog.records if "microbatch-invariant" in r.getMessage()]
        assert (len(said) == 1 and "of 1 examples" in said[0]) if mixes else not said, said
