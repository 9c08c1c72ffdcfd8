"""The second microbatch count's layer plans solve on another thread while the first count's
one-row microbatch is traced (`inter_op._fill_ahead`): the search's answer is the one it gives
without."""
from __future__ import annotations

from planner.core.options import PlanOptions
from planner.stages import inter_op
from planner.stages.inter_op import plan_pipeline
from planner.stages.submesh import make_cluster
from zoo import get_model


def _plan(b, args):
    return plan_pipeline(b.train_step, args, make_cluster(1, 4, "a100"), PlanOptions(pipeline=True), max_mesh_ndim=1)


def test_fill_ahead_changes_nothing(monkeypatch):
    b = get_model("gpt-tiny", batch=4)
    args = (b.abstract_state(), b.abstract_batch())
    ahead = []
    real = inter_op._fill_ahead
    monkeypatch.setattr(inter_op, "_fill_ahead", lambda space: ahead.append(real(space)) or ahead[-1])
    with_it = _plan(b, args)
    assert ahead and ahead[0] is not None and ahead[0][0] == 2 and ahead[0][1].done()
    monkeypatch.setattr(inter_op, "_fill_ahead", lambda space: None)
    without = _plan(b, args)
    assert with_it.candidates == without.candidates
    assert with_it.step_time_s == without.step_time_s
    assert [(s.layer_range, s.mesh, s.specs) for s in with_it.stages] == \
        [(s.layer_range, s.mesh, s.specs) for s in without.stages]
