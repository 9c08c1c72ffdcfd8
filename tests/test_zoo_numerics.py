"""Every zoo model at a small size, planned on a 2-D mesh (2x4), equals the unsharded train step.

`make fuzz` also runs them on 1x8 (ZOO_MESHES=2x4,1x8); gpt-tiny is covered on 2x4, 1x8 and 8x1
with fidelity checks in test_numerics.py."""
from __future__ import annotations

import os

import jax
import pytest

import planner
from zoo import model_names
from tests.helpers import assert_bundle_step_close, concrete

MESHES = os.environ.get("ZOO_MESHES", "2x4").split(",")
TINY = [n for n in model_names() if n.endswith("-tiny") and n != "gpt-tiny"]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", TINY)
def test_zoo_model_matches_unsharded(name, mesh, devices8):
    b, state, batch = concrete(name)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
