"""The comparison helpers of tests/helpers.py can fail: a reordered sum passes, a wrong gradient
or a wrong update does not."""
from __future__ import annotations

import jax
import pytest

from tests.helpers import assert_first_step_close, assert_gradients_close, longest_reduction


def test_longest_reduction_reads_the_program(gpt_tiny):
    b, _, state, batch, *_ = gpt_tiny
    c = b.config
    # The weight gradients contract over every token of the batch.
    assert longest_reduction(b.train_step, state, batch) == max(c.batch * c.seq, c.vocab, c.mlp_ratio * c.d_model)


def test_reordered_microbatch_sum_passes_and_half_batch_fails(gpt_tiny):
    b, _, state, batch, ref_state, _ = gpt_tiny
    n = longest_reduction(b.train_step, state, batch)
    grad = jax.jit(jax.grad(b.loss_fn))
    want = grad(state["params"], batch)
    halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
    reordered = jax.tree.map(lambda g0, g1: (g0 + g1) / 2, *(grad(state["params"], h) for h in halves))
    assert_gradients_close(b.loss_fn, state["params"], batch, reordered, want, n)
    with pytest.raises(AssertionError, match="gradient"):
        assert_gradients_close(b.loss_fn, state["params"], batch, grad(state["params"], halves[0]), want, n)


def test_a_wrong_update_fails(gpt_tiny):
    b, opt, state, batch, ref_state, ref_metrics = gpt_tiny
    assert_first_step_close(b.loss_fn, opt, state, batch, ref_state, ref_metrics, ref_state, ref_metrics)
    # Same gradients, but one parameter moved by a tenth of a learning rate too far.
    bad = jax.tree.map(lambda x: x, ref_state)
    kernel = bad["params"]["lm_head"]["kernel"]
    bad["params"]["lm_head"]["kernel"] = kernel.at[0, 0].add(0.1 * b.config.learning_rate)
    with pytest.raises(AssertionError, match="update"):
        assert_first_step_close(b.loss_fn, opt, state, batch, bad, ref_metrics, ref_state, ref_metrics)
