"""Known answers beyond MLP/GPT: expert parallelism for MoE; donated train state."""
from __future__ import annotations

import jax

import planner
from zoo import get_model
from tests.helpers import assert_bundle_step_close, concrete
from xla_hooks.inspect import collectives


def test_large_experts_many_tokens_give_expert_parallelism(devices8):
    """Experts hold >90% of the weights and 4096 tokens flow per step: the planner splits the
    expert dim of every expert weight over the mesh and moves tokens with all-to-all."""
    b = get_model("moe-large-experts")
    state, batch = b.abstract_state(), b.abstract_batch()
    step = planner.plan_parallel(b.train_step, mesh="1x8")
    plan = step.plan(state, batch)
    experts = [(p, s) for p, s in zip(plan.input_paths, plan.input_specs)
               if p.startswith("[0]['params']") and ("['wi']" in p or "['wo']" in p)]
    assert experts
    for path, spec in experts:
        assert spec[0] and plan.mesh.axis_size(spec[0]) == 8 and not any(spec[1:]), (path, spec)
    a2a = [c for c in collectives(step.lower(state, batch).compile()) if c.kind == "all-to-all"]
    assert a2a and all(c.group_size == 8 for c in a2a)


def test_donated_state(devices8):
    b, state, batch = concrete("mlp-tiny")
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    step = planner.plan_parallel(b.train_step, mesh="2x4", donate_argnums=0)
    copy = jax.tree_util.tree_map(lambda x: x.copy(), state)  # donation consumes the buffers
    placed = jax.device_put(copy, step.plan(state, batch).in_shardings[0])
    new_state, metrics = step(placed, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    leaf = jax.tree_util.tree_leaves(placed)[0]
    assert leaf.is_deleted()  # the old state's buffers went to the new state
