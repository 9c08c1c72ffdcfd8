"""Every zoo model at a small size, planned on 2x4 and 1x8, equals the unsharded train step."""
from __future__ import annotations

import jax
import pytest

import planner
from zoo import model_names
from tests.helpers import assert_bundle_step_close, concrete

# gpt-tiny is covered on three meshes with fidelity checks in test_numerics.py.
TINY = [n for n in model_names() if n.endswith("-tiny") and n != "gpt-tiny"]


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
@pytest.mark.parametrize("name", TINY)
def test_zoo_model_matches_unsharded(name, mesh, devices8):
    b, state, batch = concrete(name)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
