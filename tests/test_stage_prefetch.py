"""A sharded-state pipeline stage that prefetches its parameter gathers (`StageOption.prefetch`):
each layer's gather issued behind the compute of the layer before it (forward) or after it
(backward), priced as the part of each gather its neighbour's free compute cannot cover, with the
next layer's gathered parameters held beside the layer computing; weighed only where collectives
overlap compute and prefetch is not off; a plan with such a stage assumes XLA's latency-hiding
scheduler (`Plan.xla_flags()`)."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from planner.core.options import PlanOptions
from planner.core.pipeline_records import PipelineStage, stage_way
from planner.emit.pipeline.planned import pipeline_xla_flags
from planner.graph.trace import trace
from planner.stages.clustering import cluster_layers
from planner.stages.cost_table import LayerCostTable
from planner.stages.stage_cost import StageOption, stage_communication, stage_ranges, stage_times
from planner.stages.submesh import boundary_link, logical_meshes, make_cluster
from zoo import get_model


def _table(hardware: str = "a100", options: PlanOptions | None = None) -> LayerCostTable:
    """gpt-tiny's six layers (embedding, four blocks, head) on one host of 4 devices."""
    b = get_model("gpt-tiny", layers=4, batch=64)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    cluster = make_cluster(2, 4, hardware)
    return LayerCostTable(graph, cluster_layers(graph), logical_meshes((1, 4), cluster, max_ndim=2), cluster,
                          options or PlanOptions(), {})


@pytest.fixture(scope="module")
def table():
    return _table()


def _hidden_by_hand(rows, first: int, last: int, backward: bool = True) -> float:
    """Each gather (half of `zero_extra_s`: forward and backward) hidden by the free compute of
    the layer it waits behind: layer l's forward gather behind l-1's forward, its backward gather
    behind l+1's backward (`backward`)."""
    free = [max(0.0, r.time_s - r.comm_s - r.hidden_s) for r in rows]
    hidden = 0.0
    for l in range(first, last + 1):
        g = rows[l].zero_extra_s / 2
        if l > first:
            hidden += min(g, free[l - 1] * rows[l - 1].fwd_fraction)
        if l < last and backward:
            hidden += min(g, free[l + 1] * (1 - rows[l + 1].fwd_fraction))
    return hidden


def test_a_recomputing_stage_prefetches_in_its_recomputed_forward_too(table):
    """Under recomputation the forward runs twice: the recomputed forward's gathers (all layers
    but the last `kept`) hide behind its compute as the first forward's do."""
    L = table.layers.num_layers
    link, boundary = boundary_link(table.cluster), np.zeros(L)
    rows = [table.cost(l, 0) for l in range(L)]
    for kept in (0, 1):
        plain = StageOption(0, "sharded-state", True, kept=kept)
        ahead = dataclasses.replace(plain, prefetch=True)
        t0, t1 = (stage_ranges(table, o, 4, boundary, link)[0] for o in (plain, ahead))
        for first, last in ((1, 4), (2, 3), (1, 5)):
            again = _hidden_by_hand(rows, first, last - kept, backward=False)
            hidden = _hidden_by_hand(rows, first, last) + again
            assert (again > 0) == (last - kept > first)  # one recomputed layer has none before it
            assert t1[first, last] == pytest.approx(t0[first, last] - hidden, rel=1e-12)
            exposed0, hidden0 = stage_communication(table, first, last, plain, 4, boundary, link)
            exposed1, hidden1 = stage_communication(table, first, last, ahead, 4, boundary, link)
            assert exposed1 == pytest.approx(exposed0 - hidden, rel=1e-12, abs=1e-15)
            assert hidden1 == pytest.approx(hidden0 + hidden, rel=1e-12)


def test_prefetch_hides_each_gather_behind_its_neighbours_compute(table):
    L = table.layers.num_layers
    link, boundary = boundary_link(table.cluster), np.zeros(L)
    rows = [table.cost(l, 0) for l in range(L)]
    assert all(r.zero_extra_s > 0 for r in rows[1:])  # the sharded state gathers the blocks' and head's weights
    plain, ahead = (StageOption(0, "sharded-state", r, prefetch=p) for r, p in ((False, False), (False, True)))
    (t0, f0, m0), (t1, f1, m1) = (stage_ranges(table, o, 4, boundary, link) for o in (plain, ahead))
    for first, last in ((1, 4), (2, 3), (1, 5), (0, 2)):
        hidden = _hidden_by_hand(rows, first, last)
        gathers = sum(r.zero_extra_s for r in rows[first:last + 1])
        assert 0 < hidden <= gathers - rows[first].zero_extra_s / 2 - rows[last].zero_extra_s / 2 + 1e-15
        assert t1[first, last] == pytest.approx(t0[first, last] - hidden, rel=1e-12)
        params = max(r.zero_work_bytes - r.work_bytes for r in rows[first:last + 1])
        assert params > 0 and f1[first, last] == pytest.approx(f0[first, last] + params, rel=1e-12)
        assert m1[first, last] == m0[first, last]
        exposed0, hidden0 = stage_communication(table, first, last, plain, 4, boundary, link)
        exposed1, hidden1 = stage_communication(table, first, last, ahead, 4, boundary, link)
        assert exposed1 == pytest.approx(exposed0 - hidden, rel=1e-12, abs=1e-15)
        assert hidden1 == pytest.approx(hidden0 + hidden, rel=1e-12)
    for l in range(L):  # a stage of one layer has no neighbour to hide behind, nor a next layer to hold
        assert t1[l, l] == t0[l, l] and f1[l, l] == f0[l, l]
    assert np.isinf(t1[2, 1])  # below the diagonal: no range


def test_the_stage_table_takes_prefetch_where_it_is_faster_and_fits(table):
    """With room for it, a sharded-state stage of several layers prefetches (faster, the next
    layer's parameters fit); with a budget between the two fixed sizes it does not; XLA:CPU
    (collectives run synchronously) and prefetch off never offer it."""
    boundary, link = np.zeros(table.layers.num_layers), boundary_link(table.cluster)
    first, last = 1, 4

    def chosen(tab, budget):
        st = stage_times(tab, [(1, 4)], [[0]], 4, "gpipe", budget, boundary, layouts=("sharded-state",),
                         remats=(False,), variants=("",))
        return st, st.options[0][int(st.option[0, first, last, 0])]

    st, way = chosen(table, np.inf)
    assert way.prefetch and not way.remat
    t_ahead, f_ahead, m_ahead = (x[first, last] for x in stage_ranges(table, way, 4, boundary, link))
    assert st.times[0, first, last, 0] == t_ahead
    _, f_plain, m_plain = (x[first, last] for x in stage_ranges(table, dataclasses.replace(way, prefetch=False), 4,
                                                                boundary, link))
    budget = (f_plain + 4 * m_plain + f_ahead + 4 * m_ahead) / 2  # the plain stage fits, the prefetching one not
    _, way = chosen(table, budget)
    assert not way.prefetch
    for other in (_table("cpu"), _table(options=PlanOptions(prefetch=False))):
        st, _ = chosen(other, np.inf)
        assert not any(o.prefetch for o in st.options[0])


def test_a_prefetching_stage_is_recorded_and_its_plan_assumes_the_latency_hiding_scheduler():
    stage = PipelineStage(state_layout="sharded-state", remat=True, prefetch=True)
    assert stage_way(stage) == "sharded-state+remat+prefetch"
    again = PipelineStage.from_json(stage.to_json(), lambda d: None)
    assert again.prefetch is True and stage_way(again) == stage_way(stage)
    cluster = make_cluster(2, 4, "a100")
    plans = [types.SimpleNamespace(assumed_xla_flags=("--xla_gpu_enable_latency_hiding_scheduler=true",
                                                      "--xla_gpu_all_reduce_combine_threshold_bytes=100")),
             types.SimpleNamespace(assumed_xla_flags=("--xla_gpu_all_reduce_combine_threshold_bytes=4096",))]
    stages = [types.SimpleNamespace(prefetch=False), types.SimpleNamespace(prefetch=False)]
    flags = pipeline_xla_flags(types.SimpleNamespace(stages=stages), plans, cluster)
    assert flags == ("--xla_gpu_enable_latency_hiding_scheduler=true",
                     "--xla_gpu_all_reduce_combine_threshold_bytes=4096")
    assert pipeline_xla_flags(types.SimpleNamespace(stages=stages), [], cluster) == ()
    stages[1] = types.SimpleNamespace(prefetch=True)
    assert pipeline_xla_flags(types.SimpleNamespace(stages=stages), [], cluster) == \
        ("--xla_gpu_enable_latency_hiding_scheduler=true",)
