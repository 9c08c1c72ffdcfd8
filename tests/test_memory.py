"""Memory budgets: a plan under a budget fits it as XLA measures it; an impossible one is refused."""
from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import planner
from tests.helpers import assert_bundle_step_close, concrete
from xla_hooks.inspect import memory_stats


def _data_parallel_peak(b, state, batch) -> int:
    """Per-device peak of hand-written data parallelism: state replicated, batch split 8 ways."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
    split = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("d")), batch)
    compiled = jax.jit(b.train_step, in_shardings=(rep, split)).lower(state, batch).compile()
    return memory_stats(compiled).peak_bytes


def test_budget_below_data_parallel_is_met_as_measured(devices8):
    b, state, batch = concrete("gpt-tiny")
    dp_peak = _data_parallel_peak(b, state, batch)
    budget = int(0.6 * dp_peak)
    step = planner.plan_parallel(b.train_step, mesh="1x8", memory_budget=budget)
    plan = step.plan(state, batch)
    assert plan.prediction.memory_bytes_per_device <= budget
    measured = memory_stats(step.lower(state, batch).compile()).peak_bytes
    assert measured <= budget, f"XLA peak {measured} > budget {budget} (data parallel: {dp_peak})"
    # Still the same numbers as the unsharded step.
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_impossible_budget_names_the_reachable_minimum(devices8):
    b = concrete("gpt-tiny")[0]
    with pytest.raises(planner.InfeasiblePlanError, match=r"smallest per-device peak the planner could reach is") as e:
        planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), mesh="1x8", memory_budget="100KB")
    assert e.value.min_memory_bytes is not None and e.value.min_memory_bytes > 100e3
