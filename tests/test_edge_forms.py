"""An edge's cost as the CP-SAT model adds it is grouped once per cost model (planner/ilp/edge_forms.py):
a model built after other ILPs on the same cost model is the model built alone, and the grouping holds
every part's cost."""
from __future__ import annotations

from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.ilp.cpsat import _Model
from planner.ilp.edge_forms import edge_form
from planner.ilp.problem import build_problem
from planner.ilp.strategies import edge_parts, part_key, part_time
from planner.ilp.ticks import _NS
from planner.search.mesh_plan import cost_model_for
from tests.helpers import zoo_graph

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))


def _proto(problem) -> str:
    model = _Model(problem)
    model.m.Minimize(model.objective)
    return str(model.m.Proto())


def test_a_model_built_on_a_shared_cost_model_is_the_model_built_alone():
    """gpt-tiny at batch 8 and 2048 on one cost model: the second's edges carry tensors of other shapes
    but the same spec lists as the first's, so a cache keyed without the tensor (or the multiplier)
    would hand the second model the first one's costs."""
    options = PlanOptions()
    small, large = zoo_graph("gpt-tiny", batch=8), zoo_graph("gpt-tiny", batch=2048)
    shared = cost_model_for(MESH_2x4, options)
    first = build_problem(small, shared)
    assert _proto(first) == _proto(build_problem(small, cost_model_for(MESH_2x4, options)))
    assert shared.edge_forms  # the first model filled the cache
    after = _proto(build_problem(large, shared))
    alone = _proto(build_problem(large, cost_model_for(MESH_2x4, options)))
    assert after == alone


def test_an_edge_form_holds_every_part_cost_of_every_spec_pair():
    """Each (producer spec, consumer spec) pair of every edge of gpt-tiny's ILP on 2x4 finds, per
    part, its own cost in the grouped form: the row holding the producer's strategy meets the column
    holding the consumer's at that part's ticks; parts left out cost nothing for every pair."""
    problem = build_problem(zoo_graph("gpt-tiny", batch=8), cost_model_for(MESH_2x4, PlanOptions()))
    cost = problem.cost
    checked = 0
    for e in problem.edges[:40]:
        if problem.rep[e.src] == problem.rep[e.dst]:
            continue
        t = problem.priced(e.tensor, e.op)
        forms = edge_form(t, e.src_specs, e.dst_specs, 1, cost)
        by_part = dict(zip(_costly_parts(t, e, cost), forms))
        for part in edge_parts(cost.mesh):
            for i, s in enumerate(e.src_specs):
                for j, d in enumerate(e.dst_specs):
                    want = int(round(part_time(t, s, part, part_key(part, d), cost) * _NS))
                    form = by_part.get(part)
                    if form is None:
                        assert want == 0
                        continue
                    r = next(k for k, idx in enumerate(form.rows) if i in idx)
                    c = next(k for k, idx in enumerate(form.cols) if j in idx)
                    assert form.ticks[c][r] == want
                    checked += 1
    assert checked > 100


def _costly_parts(t, e, cost):
    """The parts of `edge_parts` that cost something for some pair of the edge's specs, in order."""
    return [part for part in edge_parts(cost.mesh)
            if any(round(part_time(t, s, part, part_key(part, d), cost) * _NS)
                   for s in e.src_specs for d in e.dst_specs)]
