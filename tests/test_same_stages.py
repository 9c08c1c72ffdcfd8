"""Stages that run the same program take one intra-op plan (`emit.pipeline.same_stages`): the
plan each gets is the plan it would get solved alone, its names its own."""
from __future__ import annotations

import jax
import optax

from planner.emit.pipeline import stage_records
from planner.emit.pipeline.runtime import PipelinedStep, even_layouts, layer_names
from planner.emit.pipeline.same_stages import program_key
from zoo import get_model


def _stages():
    b = get_model("gpt-tiny", layers=6, batch=8, seq=16, d_model=32, vocab=64)
    params, batch = b.abstract_state()["params"], b.abstract_batch()
    names = layer_names(b.loss_fn, params, batch)
    step = PipelinedStep(b.loss_fn, optax.adamw(1e-3), even_layouts(names, jax.devices()[:8], 4), 2, "1f1b")
    return step._layout(params, batch)[1]


def test_repeated_stages_take_the_plan_solved_alone(monkeypatch):
    stages = _stages()
    keys = [program_key(st.sg.graph) for st in stages]
    # pre+blocks_0 | blocks_1, blocks_2 | blocks_3, blocks_4 | blocks_5+post: the middle two repeat.
    assert keys[1] == keys[2] and len(set(keys)) == 3
    alone = [stage_records.stage_plan(st, ()) for st in stages]
    solved = []
    real = stage_records.make_plan
    monkeypatch.setattr(stage_records, "make_plan", lambda *a, **k: solved.append(1) or real(*a, **k))
    plans = stage_records.stage_plans(stages, ())
    assert len(solved) == 3
    for got, want, st in zip(plans, alone, stages):
        assert got == want  # specs, prediction, decisions and their labels: Plan's equality
        assert got.input_paths == st.sg.graph.input_paths
    # The renamed plan names its own layers only.
    assert any("blocks_3" in d.label for d in plans[2].decisions)
    assert not any("blocks_1" in d.label or "blocks_2" in d.label for d in plans[2].decisions)
