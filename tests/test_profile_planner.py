"""The planner follows the profile: data parallelism on the slow mesh axis, tensor parallelism on the fast one."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

import planner
from planner.cost_model import AxisLink, ProfileDB
from planner.core.errors import ProfileError
from zoo import get_model
from tests.conftest import skip_if_fewer_devices

# Per-link figures of the synthetic profile: the slow axis is 10x slower in latency and bandwidth,
# like a cross-host axis next to an NVLink one.
FAST = AxisLink(5e-6, 1 / 100e9)
SLOW = AxisLink(50e-6, 1 / 10e9)


def _axes(spec) -> set[int]:
    return {a for dim in spec for a in dim}


@pytest.mark.parametrize("slow", [0, 1])
def test_data_parallel_on_the_slow_axis_tensor_parallel_on_the_fast_one(slow, tmp_path):
    """Weights (12 d^2 per layer) outweigh activations (batch x seq x d), so the fast axis should
    split the weights (Megatron tensor parallelism) and the slow axis the batch."""
    skip_if_fewer_devices(8)
    fast = 1 - slow
    links = (SLOW, FAST) if slow == 0 else (FAST, SLOW)
    db = ProfileDB.synthetic((2, 4), links)
    profile = db
    if slow == 1:  # also exercise the file path
        profile = str(tmp_path / "profile.json")
        db.save(profile)
    bundle = get_model("gpt-tiny", layers=1, d_model=256)
    state, batch = bundle.abstract_state(), bundle.abstract_batch()
    step = planner.plan_parallel(bundle.train_step, mesh="2x4", profile=profile)
    plan, graph = step.plan(state, batch), step.graph(state, batch)

    # data parallelism: the forward activations and the targets are split by batch on the slow axis only
    op_specs = {(i, k): spec for i, k, spec in plan.op_specs}
    fc_in = [op for op in graph.ops if op.primitive.name == "dot_general"
             and op.name_stack.endswith("blocks_0/mlp/fc_in") and "transpose" not in op.name_stack]
    assert len(fc_in) == 1
    hidden = op_specs[(fc_in[0].index, 0)]  # (batch, seq, 4 d_model)
    assert hidden[0] == (slow,), hidden
    assert plan.spec_of("[1]['targets']")[0] == (slow,)
    # tensor parallelism: the MLP hidden dim and every weight matrix are split on the fast axis
    assert hidden[2] == (fast,), hidden
    kernels = [(p, s) for p, s in zip(plan.input_paths, plan.input_specs)
               if p.startswith("[0]['params']['blocks_") and p.endswith("['kernel']")]
    assert len(kernels) == 6
    for path, spec in kernels:
        assert fast in _axes(spec), (path, spec)


def test_plan_with_a_corrupt_profile_is_a_profile_error(tmp_path):
    skip_if_fewer_devices(8)
    path = tmp_path / "profile.json"
    path.write_text('{"format": "planner-profile", "version": 1')
    with pytest.raises(ProfileError, match=f"{path}.*not valid JSON"):
        planner.plan(lambda x: x * 2.0, jnp.ones((8, 8)), mesh="2x4", profile=str(path))
