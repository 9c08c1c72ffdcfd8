"""A pipeline stage whose saved activations wait in host memory between each microbatch's forward and
backward (`StageOption.offload_acts`, `StageLayout.offload_activations`): priced with one
microbatch's activations going out and one coming back on the device and the host trips
overlapping the stage's compute, weighed where keeping the activations does not fit, and run: the
same step as the unpipelined one, every microbatch's saved values copied to `pinned_host` and back."""
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
from planner.stages.layer_facts import boundary_bytes
from planner.stages.stage_cost import StageOption, stage_ranges, stage_times
from planner.stages.submesh import boundary_link, logical_meshes, make_cluster
from tests import mlp_pipeline
from tests.conftest import skip_if_fewer_devices
from tests.helpers import assert_first_step_close
from zoo import get_model


@pytest.fixture(scope="module")
def table():
    b = get_model("gpt-tiny", layers=4, batch=64)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    cluster = make_cluster(2, 4, "a100")
    return graph, LayerCostTable(graph, cluster_layers(graph), logical_meshes((1, 4), cluster, max_ndim=2), cluster,
                                 PlanOptions(), {})


def test_offloaded_activations_are_priced_as_two_microbatches_and_the_host_trips(table):
    graph, table = table
    link, boundary = boundary_link(table.cluster), boundary_bytes(graph, table.layers)
    rows = [table.cost(l, 0) for l in range(table.layers.num_layers)]
    kept, hosted = (stage_ranges(table, StageOption(0, "plan", False, offload_acts=h), 4, boundary, link)
                    for h in (False, True))
    first, last = 1, 4
    act = sum(rows[l].act_bytes for l in range(first, last + 1))
    assert act > 0 and kept[2][first, last] == pytest.approx(act, rel=1e-12)
    assert hosted[2][first, last] == 0.0
    assert hosted[1][first, last] == pytest.approx(kept[1][first, last] + 2 * act, rel=1e-12)
    trip = act / table.cluster.hardware.host_bandwidth  # each way, each on its own direction of the link
    assert hosted[0][first, last] == pytest.approx(max(kept[0][first, last], trip), rel=1e-12)
    assert np.isinf(hosted[0][first + 1, first])  # below the diagonal: no range


def test_the_stage_table_weighs_offloaded_activations_only_where_keeping_them_does_not_fit(table):
    graph, table = table
    link, boundary = boundary_link(table.cluster), boundary_bytes(graph, table.layers)
    first, last, q = 1, 4, 8
    _, fixed, per_mb = stage_ranges(table, StageOption(0, "plan", False), 4, boundary, link)
    roomy = stage_times(table, [(1, 4)], [[0]], q, "gpipe", np.inf, boundary, layouts=("plan",), variants=("",))
    assert not any(o.offload_acts for o in roomy.options[0])
    _, hfixed, _ = stage_ranges(table, StageOption(0, "plan", False, offload_acts=True), 4, boundary, link)
    budget = max(hfixed[first, last], fixed[first, last] + per_mb[first, last]) * 1.01
    assert budget < fixed[first, last] + q * per_mb[first, last]
    st = stage_times(table, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("plan",), variants=("",))
    hosted = [j for j, o in enumerate(st.options[0]) if o.offload_acts]
    assert len(hosted) == 1
    fitting = {}
    for o in st.options[0]:
        t, f, p = (x[first, last] for x in stage_ranges(table, o, 4, boundary, link))
        if np.isfinite(t) and f + q * p <= budget:
            fitting[o] = t
    hosted_option = st.options[0][hosted[0]]
    assert hosted_option in fitting and StageOption(0, "plan", False) not in fitting
    chosen = st.options[0][int(st.option[0, first, last, 0])]
    assert st.times[0, first, last, 0] == min(fitting.values()) == fitting[chosen]
    others = min(t for o, t in fitting.items() if o != hosted_option)
    assert chosen.offload_acts == (fitting[hosted_option] < others), (chosen, fitting)
    off = dataclasses.replace(table, options=PlanOptions(offload="off"))
    none = stage_times(off, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("plan",), variants=("",))
    assert not any(o.offload_acts for o in none.options[0])


def _loss(p, b):
    return mlp_pipeline.loss(p, *b)


def _plain_step_close(params, opt_state, x, y, new_params, new_opt, loss):
    ref_params, ref_opt, ref_l = jax.jit(mlp_pipeline.step)(params, opt_state, x, y)
    assert_first_step_close(_loss, mlp_pipeline.OPT, {"params": params, "opt_state": opt_state}, (x, y),
                            {"params": new_params, "opt_state": new_opt}, {"loss": loss},
                            {"params": ref_params, "opt_state": ref_opt}, {"loss": ref_l},
                            train_step=lambda s, b: mlp_pipeline.step(s["params"], s["opt_state"], *b))


def test_a_stage_offloading_its_activations_runs_the_plain_step(monkeypatch):
    """mlp_pipeline's second stage with its activations in host memory: every microbatch's saved
    values go to `pinned_host` after its forward and come back before its backward, and the step
    equals the unpipelined one."""
    skip_if_fewer_devices(8)
    params, opt_state, x, y = mlp_pipeline.inputs()
    base = even_layouts(layer_names(_loss, params, (x, y)), jax.devices()[:8], 2)
    lay = dataclasses.replace(base[1], offload_activations=True)
    B = 4
    step = PipelinedStep(_loss, mlp_pipeline.OPT, [base[0], lay], B, "1f1b")
    step.lower(params, opt_state, (x, y))  # compiled before the copies are counted
    moves, real = [], jax.device_put

    def kind(x):
        return getattr(getattr(x, "sharding", None), "memory_kind", None)

    def put(v, s=None, **k):
        moves.append((kind(v), getattr(s, "memory_kind", None)))
        return real(v, s, **k)

    monkeypatch.setattr(jax, "device_put", put)
    new, metrics = step({"params": params, "opt_state": opt_state}, (x, y))
    monkeypatch.undo()
    out, back = moves.count(("device", "pinned_host")), moves.count(("pinned_host", "device"))
    assert out == back and out >= B and out % B == 0, moves  # each microbatch's saved values, out and back
    _plain_step_close(params, opt_state, x, y, new["params"], new["opt_state"], metrics["loss"])
    with pytest.raises(InvalidArgumentError, match="offload_activations"):
        dataclasses.replace(base[1], remat=True, offload_activations=True)


def test_a_planned_stage_offloading_its_activations_runs_from_the_plan_json():
    skip_if_fewer_devices(8)
    params, opt_state, x, y = mlp_pipeline.inputs()
    planned = planner.plan_parallel(mlp_pipeline.step, hardware="2x4:v100", inter_host="1Gbit", pipeline=True)
    plan = planned.plan(params, opt_state, x, y)
    last = plan.stages[-1]
    assert len(plan.stages) >= 2 and not last.remat
    stages = plan.stages[:-1] + (dataclasses.replace(last, offloaded_activations=True),)
    back = planner.Plan.from_json(dataclasses.replace(plan, stages=stages).to_json())
    assert back.stages[-1].offloaded_activations and "+offloaded-activations" in back.summary()
    _plain_step_close(params, opt_state, x, y, *run_plan(mlp_pipeline.step, back, jax.devices()[:8])(
        params, opt_state, x, y))
