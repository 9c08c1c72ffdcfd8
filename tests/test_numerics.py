"""The planned GPT train step equals the unsharded one, and XLA communicates as predicted."""
from __future__ import annotations

import jax
import pytest

import planner
from tests.helpers import assert_bundle_step_close
from xla_hooks.fidelity import check_fidelity


@pytest.mark.parametrize("mesh", ["2x4", "1x8", "8x1"])
def test_gpt_train_step_matches_unsharded(gpt_tiny, mesh, devices8):
    b, _, state, batch, ref_state, ref_metrics = gpt_tiny
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    # The new state comes back with the sharding it went in with (no resharding next step).
    plan = step.plan(state, batch)
    for leaf, sharding in zip(jax.tree_util.tree_leaves(new_state),
                              jax.tree_util.tree_leaves(plan.out_shardings[0])):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    # Fidelity: the compiled program's collectives are the predicted ones.
    report = check_fidelity(plan, step.lower(state, batch).compile())
    assert report.ok, report.table()


def test_fidelity_reports_a_mismatch(gpt_tiny, devices8):
    """A program compiled from one plan, checked against another plan's prediction, must not pass."""
    b, _, state, batch, *_ = gpt_tiny
    dp = planner.plan_parallel(b.train_step, mesh="1x8")
    compiled = dp.lower(state, batch).compile()
    plan = dp.plan(state, batch)
    import dataclasses

    pred = plan.prediction
    fake = dataclasses.replace(plan, prediction=dataclasses.replace(pred, collectives=pred.collectives[:1]))
    report = check_fidelity(fake, compiled)
    assert not report.ok
    assert "all-reduce" in report.table()
