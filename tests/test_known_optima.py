"""Textbook answers, asserted on the compiled HLO, not only on the plan: data parallelism when the
batch dwarfs the weights, Megatron's column-then-row split when the weights dwarf the batch, expert
parallelism (all-to-all) when MoE experts hold the weights and many tokens flow."""
from __future__ import annotations

import jax
import pytest

import planner
from zoo import get_model
from tests.helpers import TALL, WIDE, assert_bundle_step_close, concrete
from xla_hooks.fidelity import check_fidelity
from xla_hooks.inspect import collectives


def _activation_bytes(cfg) -> int:
    return cfg["batch"] * cfg["hidden"] * 4


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_batch_much_larger_than_hidden_is_data_parallel(mesh, devices8):
    # 4x TALL's batch: at 16384 rows the step is ~50 us on the default A100, its dots at the kernel
    # launch floor, and 4-way data parallelism with a cheaper (4-device) all-reduce is rightly
    # predicted faster than 8-way; at 65536 rows compute dominates and the textbook answer holds.
    cfg = {**TALL, "batch": 4 * TALL["batch"]}
    b = get_model("mlp-tiny", **cfg)
    state, batch = b.abstract_state(), b.abstract_batch()
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    plan = step.plan(state, batch)
    # Batch split over every device; every weight whole on every device.
    x_spec = plan.spec_of("[1]['x']")
    assert plan.mesh.axis_size(x_spec[0]) == 8 and x_spec[1] == ()
    for path, spec in zip(plan.input_paths, plan.input_specs):
        if path.startswith("[0]['params']"):
            assert all(not axes for axes in spec), (path, spec)
    cols = collectives(step.lower(state, batch).compile())
    assert cols and all(c.kind == "all-reduce" for c in cols)
    # No activation ever crosses devices: the collectives carry gradients only.
    weights = 2 * (TALL["in_dim"] * TALL["hidden"] + TALL["hidden"] * TALL["out_dim"]) * 4
    assert sum(c.result_bytes for c in cols) <= weights
    assert max(c.result_bytes for c in cols) < _activation_bytes(cfg) / 8


def test_hidden_much_larger_than_batch_is_megatron(devices8):
    b, state, batch = concrete("mlp-tiny", **WIDE)
    step = planner.plan_parallel(b.train_step, mesh="1x8")
    plan = step.plan(state, batch)
    assert plan.spec_of("[0]['params']['dense_0']['kernel']") == ((), (1,))  # column split
    assert plan.spec_of("[0]['params']['dense_1']['kernel']") == ((1,), ())  # row split
    compiled = step.lower(state, batch).compile()
    cols = collectives(compiled)
    assert [c.kind for c in cols] == ["all-reduce"]  # one activation all-reduce per forward
    assert cols[0].result_bytes == WIDE["batch"] * WIDE["out_dim"] * 4
    assert cols[0].group_size == 8
    assert check_fidelity(plan, compiled).ok
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)


def test_large_experts_many_tokens_give_expert_parallelism(devices8):
    """Experts hold >90% of the weights and 4096 tokens flow per step: with every collective on the
    critical path, the planner splits the expert dim of every expert weight over the mesh and moves
    tokens with all-to-all (GShard's layout). Weighing prefetch (the default) may instead gather the
    sharded experts ahead of their use, hidden behind earlier compute; that plan must then be
    predicted faster than the expert-parallel one."""
    b = get_model("moe-large-experts")
    state, batch = b.abstract_state(), b.abstract_batch()
    step = planner.plan_parallel(b.train_step, mesh="1x8", prefetch=False)
    plan = step.plan(state, batch)
    weighed = planner.plan_parallel(b.train_step, mesh="1x8").plan(state, batch)
    assert weighed.prediction.step_time_s <= plan.prediction.step_time_s * (1 + 1e-9)
    if weighed.levers.prefetch is not None:
        assert weighed.levers.prefetch.without_step_time_s == pytest.approx(plan.prediction.step_time_s, rel=1e-9)
    experts = [(p, s) for p, s in zip(plan.input_paths, plan.input_specs)
               if p.startswith("[0]['params']") and ("['wi']" in p or "['wo']" in p)]
    assert experts
    for path, spec in experts:
        assert spec[0] and plan.mesh.axis_size(spec[0]) == 8 and not any(spec[1:]), (path, spec)
    a2a = [c for c in collectives(step.lower(state, batch).compile()) if c.kind == "all-to-all"]
    assert a2a and all(c.group_size == 8 for c in a2a)
