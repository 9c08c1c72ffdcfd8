"""Large widths plan abstractly (nothing allocated) on a 64-device mesh description.

Layer sharing makes the ILP independent of depth, so 2- and 3-layer models at the full widths of
GPT-3 39B and Llama 70B test what the full depths would: the same number of distinct decisions,
valid specs, and a train state split at least 8-way. The full depths are planned by
experiments/bench_large_models.py.
"""
from __future__ import annotations

import pytest

import planner
from planner.core.mesh import MeshSpec
from zoo import get_model
from planner.core.options import PlanOptions
from planner.search.mesh_plan import make_plan
from planner.core.sharding import is_valid

MESH = MeshSpec((8, 8), ("data", "model"))


def _plan(name: str, layers: int):
    b = get_model(name, layers=layers)
    graph = planner.trace(b.train_step, b.abstract_state(), b.abstract_batch())
    # optimality is not what this tests (layer sharing and valid, split specs are): a short limit
    return graph, make_plan(graph, MESH, PlanOptions(solver_time_limit=5))


@pytest.mark.parametrize("name", ["gpt3-39b", "llama-70b"])
def test_large_widths_plan_on_8x8_description(name):
    graph2, plan2 = _plan(name, 2)
    graph3, plan3 = _plan(name, 3)
    for plan in (plan2, plan3):
        assert plan.solver.status in ("optimal", "feasible")
    # Repeated layers are planned once: one more layer add decisions but no distinct ones.
    assert plan3.solver.decisions > plan2.solver.decisions
    assert plan3.solver.variables_shared == plan2.solver.variables_shared
    for t, spec in zip(graph3.inputs, plan3.input_specs):
        assert is_valid(graph3.tensors[t].shape, spec, MESH)
    # Per-device train state: a replicated copy would not fit any device; the big weights and
    # their optimizer moments must be split (at least 8-way on average).
    total = sum(graph3.tensors[t].nbytes for t in graph3.inputs)
    per_device = sum(graph3.tensors[t].nbytes // MESH.axis_size([a for axes in s for a in axes])
                     for t, s in zip(graph3.inputs, plan3.input_specs))
    assert per_device <= total / 8, (per_device, total)
