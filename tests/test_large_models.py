"""Large shapes plan abstractly (nothing allocated) on a 64-device mesh description."""
from __future__ import annotations

import pytest

import planner
from planner.mesh import MeshSpec
from planner.models import get_model
from planner.options import PlanOptions
from planner.planning import make_plan
from planner.sharding import is_valid


@pytest.mark.parametrize("name", ["gpt3-39b", "llama-70b"])
def test_large_model_plans_on_8x8_description(name):
    b = get_model(name)
    graph = planner.trace(b.train_step, b.abstract_state(), b.abstract_batch())
    mesh = MeshSpec((8, 8), ("data", "model"))
    plan = make_plan(graph, mesh, PlanOptions(solver_time_limit=120))
    assert plan.solver["status"] in ("optimal", "feasible")
    assert plan.solver["variables_shared"] < plan.solver["decisions"] / 10  # layers planned once
    for t, spec in zip(graph.inputs, plan.input_specs):
        assert is_valid(graph.tensors[t].shape, spec, mesh)
    # Per-device train state: a replicated copy would not fit any device; the big weights and
    # their optimizer moments must be split (at least 8-way on average).
    total = sum(graph.tensors[t].nbytes for t in graph.inputs)
    per_device = sum(graph.tensors[t].nbytes // mesh.axis_size([a for axes in s for a in axes])
                     for t, s in zip(graph.inputs, plan.input_specs))
    assert per_device <= total / 8, (per_device, total)
