"""A pipeline stage that recomputes some of its layers: the last `kept` layers keep their
activations, the layers before them are recomputed in the backward (`StageOption.kept`,
`StageLayout.kept_layers`). Priced between recomputing all and none, taken where only
recomputation fits, and run: the same step as the unpipelined one, with the forward's saved
values (read from XLA's compiled programs) between those of the two extremes."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import planner
from planner.core.errors import InvalidArgumentError
from planner.core.options import PlanOptions
from planner.emit.pipeline.planned import run_plan
from planner.emit.pipeline.runtime import PipelinedStep, even_layouts, layer_names
from planner.graph.trace import trace
from planner.stages.clustering import cluster_layers
from planner.stages.cost_table import LayerCostTable
from planner.stages.stage_cost import StageOption, kept_levels, stage_ranges, stage_times
from planner.stages.submesh import boundary_link, logical_meshes, make_cluster
from planner.stages.layer_facts import boundary_bytes
from tests import mlp_pipeline
from tests.conftest import skip_if_fewer_devices
from tests.helpers import assert_first_step_close
from zoo import get_model


@pytest.fixture(scope="module")
def table():
    b = get_model("gpt-tiny", layers=4, batch=64)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    layers = cluster_layers(graph)
    cluster = make_cluster(2, 4, "a100")
    return graph, LayerCostTable(graph, layers, logical_meshes((1, 4), cluster, max_ndim=2), cluster,
                                 PlanOptions(), {})


def test_keeping_the_last_layers_is_priced_between_recomputing_all_and_none(table):
    """Layers k..i keeping their last j: the forward of k..i-j once more (time between none and
    all), per microbatch in flight the stage input and the last j layers' activations, and the
    recomputed layers' activations once; a range of j layers or fewer is not offered (it would be
    keeping all)."""
    graph, table = table
    L = table.layers.num_layers
    assert L == 6 and table.layers.method == "modules"  # pre, blocks_0..3, post
    assert kept_levels(table) == (1, 2, 3, 4)
    link, boundary = boundary_link(table.cluster), boundary_bytes(graph, table.layers)
    rows = [table.cost(l, 0) for l in range(L)]
    none, every = (stage_ranges(table, StageOption(0, "plan", r), 4, boundary, link) for r in (False, True))
    first, last = 1, 4
    stage_input = boundary[first - 1] / 4
    for j in (1, 2, 3):
        t, fixed, per_mb = stage_ranges(table, StageOption(0, "plan", True, "", j), 4, boundary, link)
        assert none[0][first, last] < t[first, last] < every[0][first, last]
        recomputed = sum(rows[l].act_bytes for l in range(first, last - j + 1))
        kept = sum(rows[l].act_bytes for l in range(last - j + 1, last + 1))
        assert per_mb[first, last] == pytest.approx(stage_input + kept, rel=1e-12)
        assert fixed[first, last] == pytest.approx(none[1][first, last] + recomputed, rel=1e-12)
        assert every[2][first, last] < per_mb[first, last] < none[2][first, last]
        # keeping j of j layers or fewer is not a way of its own
        assert np.isinf(t[first, first + j - 1]) and np.isinf(per_mb[first, first + j - 1])


def test_the_stage_table_keeps_the_last_layers_where_only_recomputation_fits(table):
    """A budget below keeping every activation of 4 in-flight microbatches but above keeping the last
    layer's: the table takes a way that keeps some, faster than recomputing all; offered no kept
    layers (a hand configuration's choices), it recomputes all."""
    graph, table = table
    link, boundary = boundary_link(table.cluster), boundary_bytes(graph, table.layers)
    first, last, q = 1, 4, 4
    need = {}
    for opt in (StageOption(0, "plan", False), StageOption(0, "plan", True, "", 1)):
        _, fixed, per_mb = stage_ranges(table, opt, 4, boundary, link)
        need[opt.kept] = fixed[first, last] + q * per_mb[first, last]
    assert need[1] < need[0]
    budget = (need[0] + need[1]) / 2
    st = stage_times(table, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("plan",), variants=("",))
    chosen = st.options[0][int(st.option[0, first, last, 0])]
    assert chosen.remat and chosen.kept >= 1, chosen
    assert chosen.name == f"plan+remat(last {chosen.kept} kept)"
    hand = stage_times(table, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("plan",), variants=("",),
                       kept=())
    assert hand.options[0][int(hand.option[0, first, last, 0])] == StageOption(0, "plan", True)
    assert st.times[0, first, last, 0] < hand.times[0, first, last, 0]


def _loss(p, b):
    return mlp_pipeline.loss(p, *b)


def _saved_bytes(step: PipelinedStep, params, batch) -> int:
    """Bytes the second stage's compiled forward returns beyond its outputs (what its backward
    reads), from XLA's `memory_analysis()`."""
    lowered = step.lower(params, mlp_pipeline.OPT.init(params), batch)
    return lowered[1].forward.compile().memory_analysis().output_size_in_bytes


def test_a_stage_keeping_its_last_layers_runs_the_plain_step():
    """mlp_pipeline's second stage (blocks_2, blocks_3 and the head) keeping 0, 1 or 2 of its last
    layers: each runs the unpipelined first Adam step, and its compiled forward returns fewer bytes
    the fewer layers it keeps."""
    skip_if_fewer_devices(8)
    params, opt_state, x, y = mlp_pipeline.inputs()
    batch = (x, y)
    names = layer_names(_loss, params, batch)
    assert names == ("blocks_0", "blocks_1", "blocks_2", "blocks_3", "post")
    base = even_layouts(names, jax.devices()[:8], 2)
    assert base[1].layers == ("blocks_2", "blocks_3", "post")
    ref_params, ref_opt, ref_l = jax.jit(mlp_pipeline.step)(params, opt_state, x, y)
    state = {"params": params, "opt_state": opt_state}
    saved = {}
    for kept in (None, 2, 1, 0):
        lay = base[1] if kept is None else dataclasses.replace(base[1], remat=True, kept_layers=kept)
        step = PipelinedStep(_loss, mlp_pipeline.OPT, [base[0], lay], 4, "1f1b")
        new, metrics = step(state, batch)
        assert_first_step_close(_loss, mlp_pipeline.OPT, state, batch, new, metrics,
                                {"params": ref_params, "opt_state": ref_opt}, {"loss": ref_l},
                                train_step=lambda s, b: mlp_pipeline.step(s["params"], s["opt_state"], *b))
        saved[kept] = _saved_bytes(step, params, batch)
    assert saved[0] < saved[1] < saved[2] < saved[None], saved


def test_kept_layers_need_remat_and_fewer_than_the_stage_has():
    skip_if_fewer_devices(8)
    params, _, x, y = mlp_pipeline.inputs()
    lay = even_layouts(layer_names(_loss, params, (x, y)), jax.devices()[:8], 2)[1]
    for bad in (dict(kept_layers=1), dict(remat=True, kept_layers=3)):
        with pytest.raises(InvalidArgumentError, match="kept_layers="):
            dataclasses.replace(lay, **bad)


def test_a_planned_stage_keeping_its_last_layer_runs_from_the_plan_json():
    """The plan's record of a stage keeping its last layer (`kept_layers`) survives its JSON form and
    the pipeline run from it keeps that layer: the step equals the plain step, and that stage's
    compiled forward returns fewer bytes than the plan's own (which keeps every activation)."""
    skip_if_fewer_devices(8)
    params, opt_state, x, y = mlp_pipeline.inputs()
    planned = planner.plan_parallel(mlp_pipeline.step, hardware="2x4:v100", inter_host="1Gbit", pipeline=True)
    plan = planned.plan(params, opt_state, x, y)
    last = plan.stages[-1]
    assert len(plan.stages) >= 2 and len(last.layers) >= 2 and not last.remat
    kept = dataclasses.replace(last, remat=True, kept_layers=1)
    edited = dataclasses.replace(plan, stages=plan.stages[:-1] + (kept,))
    back = planner.Plan.from_json(edited.to_json())
    assert back.stages[-1].kept_layers == 1 and "+remat(last 1 kept)" in back.summary()
    devices = jax.devices()[:8]
    new_params, new_opt, l = run_plan(mlp_pipeline.step, back, devices)(params, opt_state, x, y)
    ref_params, ref_opt, ref_l = jax.jit(mlp_pipeline.step)(params, opt_state, x, y)
    assert_first_step_close(_loss, mlp_pipeline.OPT, {"params": params, "opt_state": opt_state}, (x, y),
                            {"params": new_params, "opt_state": new_opt}, {"loss": l},
                            {"params": ref_params, "opt_state": ref_opt}, {"loss": ref_l},
                            train_step=lambda s, b: mlp_pipeline.step(s["params"], s["opt_state"], *b))
    saved = [run_plan(mlp_pipeline.step, p, devices).lower(params, opt_state, x, y)[-1].forward.compile()
             .memory_analysis().output_size_in_bytes for p in (back, plan)]
    assert saved[0] < saved[1], saved


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_stage_table_is_the_fastest_way_that_fits_at_every_in_flight_count(table, schedule):
    """`stage_times` keeps one range table per way (bucketed by how many in-flight counts it fits);
    its tables equal weighing every way at every in-flight count and range, the first offered
    winning a tie, on budgets from none fitting to all fitting (every mesh and layout)."""
    graph, table = table
    from planner.stages.stage_cost import once_per_step_ranges, update_peak
    L = table.layers.num_layers
    boundary, link = boundary_bytes(graph, table.layers), boundary_link(table.cluster)
    shapes, meshes = [(1, 4)], [list(range(len(table.meshes)))]
    roomy = stage_times(table, shapes, meshes, 8, schedule, np.inf, boundary)
    needs = []
    for m, (n, k) in enumerate(shapes):
        for opt in roomy.options[m]:
            _, fixed, per_mb = stage_ranges(table, opt, n * k, boundary, link)
            needs += list((fixed + per_mb)[np.isfinite(fixed + per_mb)])
    for budget in [np.inf, *np.quantile(needs, [0.02, 0.3, 0.6, 0.9])]:
        st = stage_times(table, shapes, meshes, 8, schedule, budget, boundary)
        for m, (n, k) in enumerate(shapes):
            counts = np.asarray(st.inflight, dtype=float)[:, None, None]
            weighed = np.full((len(counts), L, L), np.inf)
            times = np.full_like(weighed, np.inf)
            option = np.full(weighed.shape, -1)
            for j, opt in enumerate(st.options[m]):
                t, fixed, per_mb = stage_ranges(table, opt, n * k, boundary, link)
                ok = np.isfinite(t) & (fixed + counts * per_mb <= budget)
                if opt.layout == "offloaded-optimizer":
                    ok &= update_peak(table, opt) <= budget
                cand = np.where(ok, t + once_per_step_ranges(table, opt)[None] / 8, np.inf)
                better = cand < weighed
                weighed, times, option = (np.where(better, cand, weighed), np.where(better, t, times),
                                          np.where(better, j, option))
            assert np.array_equal(st.option[..., m], option), (budget, m)
            assert np.array_equal(st.times[..., m], times), (budget, m)
