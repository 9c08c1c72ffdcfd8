"""Stages that run the same program take one intra-op plan (`emit.pipeline.same_stages`): the
plan each gets is the plan it would get solved alone, its names its own."""
from __future__ import annotations

import jax
import optax

from planner.emit.pipeline import stage_records
from planner.emit.pipeline.runtime import PipelinedStep, even_layouts, layer_names
from planner.emit.pipeline.programs import stage_graph
from planner.emit.pipeline.same_stages import program_key
from planner.emit.pipeline.stage_reuse import StageGraphs
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


def _same_graph(a, b) -> None:
    """`a` and `b` the same traced program, op for op, names included."""
    ga, gb = a.graph, b.graph
    assert [(t.shape, t.dtype) for t in ga.tensors] == [(t.shape, t.dtype) for t in gb.tensors]
    assert len(ga.ops) == len(gb.ops)
    for x, y in zip(ga.ops, gb.ops):
        assert (x.name, x.name_stack, x.inputs, x.outputs) == (y.name, y.name_stack, y.inputs, y.outputs)
        assert repr(sorted(x.params.items())) == repr(sorted(y.params.items()))
    assert (ga.inputs, ga.input_paths, ga.outputs, ga.output_paths) == (gb.inputs, gb.input_paths, gb.outputs,
                                                                        gb.output_paths)
    assert sorted(ga.regions) == sorted(gb.regions)
    for k in ga.regions:
        assert [(r.kind, r.start, r.end, r.name_stack, r.operands, r.outputs) for r in ga.regions[k]] == \
            [(r.kind, r.start, r.end, r.name_stack, r.operands, r.outputs) for r in gb.regions[k]]
    assert sorted(ga.consts) == sorted(gb.consts)
    assert (a.split, a.residuals, dict(a.inputs), dict(a.outputs)) == (b.split, b.residuals, dict(b.inputs),
                                                                       dict(b.outputs))
    assert program_key(ga) == program_key(gb)


def test_repeated_stages_take_one_trace_renamed_as_their_own():
    """A stage that is an earlier stage's program takes that stage's trace with its own module
    paths (`stage_reuse`): the same program, names included, as tracing it, for every stage of
    gpt-tiny (6 layers in 4 stages: the middle two repeat) and llama-tiny (whose blocks hold
    custom-derivative calls)."""
    for name, kw in (("gpt-tiny", dict(layers=6, batch=8, seq=16, d_model=32, vocab=64)),
                     ("llama-tiny", dict(layers=6, batch=8, seq=16, scan_layers=False))):
        b = get_model(name, **kw)
        params, batch = b.abstract_state()["params"], b.abstract_batch()
        names = layer_names(b.loss_fn, params, batch)
        step = PipelinedStep(b.loss_fn, optax.adamw(1e-3), even_layouts(names, jax.devices()[:8], 4), 2, "1f1b")
        graph, stages = step._layout(params, batch)[:2]
        traces = StageGraphs()
        n = len(jax.tree_util.tree_leaves(params))
        for st in stages:
            args = (graph, st.ops, tuple(graph.inputs[k] for k in st.own), st.acts_in, st.aux_in,
                    tuple(graph.inputs[n + k] for k in st.bl), st.outs, st.aux_out)
            got = traces.get(*args)
            _same_graph(got, stage_graph(*args))
            _same_graph(st.sg, got)
        assert traces.reused >= 1, name
        # the repeated stage's names are its own (checked against its trace above), not the first's
        assert {op.name_stack for op in stages[2].sg.graph.ops} != {op.name_stack for op in stages[1].sg.graph.ops}


def test_stage_traces_are_shared_across_cuts_through_a_store():
    """A store that outlives one call (a sweep's `PlanningMemo.stage_traces`): a cut of the same
    step into other stages at the same microbatch size takes the loss trace and every stage that
    is the same program as one traced before, each the program its own trace gives."""
    b = get_model("gpt-tiny", layers=6, batch=8, seq=16, d_model=32, vocab=64)
    params, batch = b.abstract_state()["params"], b.abstract_batch()
    names = layer_names(b.loss_fn, params, batch)
    store: dict = {}
    first = StageGraphs(store)
    four = PipelinedStep(b.loss_fn, optax.adamw(1e-3), even_layouts(names, jax.devices()[:8], 4), 2, "1f1b")
    four._layout(params, batch, first)
    again = StageGraphs(store)
    three = PipelinedStep(b.loss_fn, optax.adamw(1e-3), even_layouts(names, jax.devices()[:6], 3), 2, "1f1b")
    graph, stages = three._layout(params, batch, again)[:2]
    assert graph is four._layout(params, batch, StageGraphs(store))[0]  # the loss traced once
    n = len(jax.tree_util.tree_leaves(params))
    for st in stages:
        _same_graph(st.sg, stage_graph(graph, st.ops, tuple(graph.inputs[k] for k in st.own), st.acts_in, st.aux_in,
                                       tuple(graph.inputs[n + k] for k in st.bl), st.outs, st.aux_out))
    alone = StageGraphs()
    three._layout(params, batch, alone)
    assert again.traced < alone.traced and again.reused > alone.reused
