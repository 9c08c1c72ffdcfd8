"""Every zoo model at a small size, planned on a 2-D mesh (2x4), equals the unsharded train step.

`make fuzz` runs every model on 2x4 and 1x8 (ZOO_MESHES=2x4,1x8). `make test` runs moe-tiny and
bert-tiny on 1x8 only: on 2x4 their ILPs take CP-SAT 8-10 s each to prove optimal on one core
(0.5 s on 1x8), and the 2-D mesh is covered by the other models here (Llama with RoPE and GQA,
Wide-ResNet with batch norm, the MLPs) and by gpt-tiny on 2x4, 1x8 and 8x1 with fidelity checks in
test_numerics.py."""
from __future__ import annotations

import os

import jax
import pytest

import planner
from zoo import model_names
from tests.helpers import assert_bundle_step_close, concrete

TINY = [n for n in model_names() if n.endswith("-tiny") and n != "gpt-tiny"]
ONE_D_ONLY = ("moe-tiny", "bert-tiny")  # 2x4 under `make fuzz`
CASES = ([(n, m) for n in TINY for m in os.environ["ZOO_MESHES"].split(",")] if "ZOO_MESHES" in os.environ
         else [(n, "1x8" if n in ONE_D_ONLY else "2x4") for n in TINY])


@pytest.mark.parametrize(("name", "mesh"), CASES)
def test_zoo_model_matches_unsharded(name, mesh, devices8):
    b, state, batch = concrete(name)
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    new_state, metrics = step(state, batch)
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
