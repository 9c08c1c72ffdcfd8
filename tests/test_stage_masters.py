"""Master parameters in host memory inside pipeline stages (`StageOption.offload_params`, the
offloaded-optimizer layout's "+params"): under mixed precision a stage's float32 parameters that
the step reads only by casts wait in host memory with their optimizer state, the device holding
their cast copies; priced as the bytes that saves, three host trips a step and the streamed
update's peak; weighed only where the plain offloaded layout fits a range but not at every
in-flight count. The runtime side: tests/test_pipeline_grad_sync.py."""
from __future__ import annotations

import dataclasses
import types

import jax
import numpy as np
import pytest

from planner.core.errors import InvalidArgumentError
from planner.core.options import PlanOptions
from planner.core.pipeline_records import PipelineStage, stage_way
from planner.emit.pipeline.runtime import PipelinedStep
from planner.graph.trace import trace
from planner.stages.candidate import once_per_step
from planner.stages.clustering import cluster_layers
from planner.stages.cost_table import LayerCostTable
from planner.stages.stage_cost import StageOption, host_ranges, stage_ranges, stage_times, update_peak
from planner.stages.submesh import boundary_link, logical_meshes, make_cluster
from tests.conftest import skip_if_fewer_devices
from zoo import get_model


def _table(dtype: str) -> LayerCostTable:
    b = get_model("gpt-tiny", layers=4, batch=64, dtype=dtype)
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    cluster = make_cluster(2, 4, "a100")
    return LayerCostTable(graph, cluster_layers(graph), logical_meshes((1, 4), cluster, max_ndim=2), cluster,
                          PlanOptions(), {})


@pytest.fixture(scope="module")
def table():
    return _table("bfloat16")


def test_master_parameters_are_priced_as_the_cast_copies_and_three_host_trips(table):
    L = table.layers.num_layers
    link, boundary = boundary_link(table.cluster), np.zeros(L)
    rows = [table.cost(l, 0) for l in range(L)]
    assert all(r.master_bytes > 0 and r.master_cast_bytes == r.master_bytes / 2 for r in rows[1:-1])  # the blocks
    plain, hosted = StageOption(0, "offloaded-optimizer", False), StageOption(0, "offloaded-optimizer", False,
                                                                              offload_params=True)
    (t0, f0, m0), (t1, f1, m1) = (stage_ranges(table, o, 4, boundary, link) for o in (plain, hosted))
    first, last = 1, 4
    saved = sum(r.master_bytes - r.master_cast_bytes for r in rows[first:last + 1])
    assert saved > 0 and f1[first, last] == pytest.approx(f0[first, last] - saved, rel=1e-12)
    assert t1[first, last] == t0[first, last] and m1[first, last] == m0[first, last]
    devices_part = sum(r.opt_state_bytes - r.opt_host_bytes - (r.master_bytes - r.master_cast_bytes)
                       for r in rows[first:last + 1])
    leaf = max(r.opt_host_leaf_bytes + r.master_leaf_bytes for r in rows[first:last + 1])
    assert update_peak(table, hosted)[first, last] == pytest.approx(devices_part + 2 * leaf, rel=1e-12)
    host = table.cluster.hardware.host_bandwidth
    masters = sum(r.master_bytes for r in rows[first:last + 1])
    assert once_per_step(table, hosted, first, last)[0] == pytest.approx(
        once_per_step(table, plain, first, last)[0] + 3 * masters / host, rel=1e-12)


def test_a_float32_step_has_no_master_parameters_to_keep_away():
    rows = [c for c in (_table("float32").cost(l, 0) for l in range(6))]
    assert not any(r.master_bytes for r in rows)


def test_the_stage_table_keeps_masters_away_only_where_the_plain_offloaded_layout_does_not_fit(table):
    L = table.layers.num_layers
    link, boundary = boundary_link(table.cluster), np.zeros(L)
    first, last, q = 1, 4, 8
    plain, hosted = StageOption(0, "offloaded-optimizer", False), StageOption(0, "offloaded-optimizer", False,
                                                                              offload_params=True)

    def chosen(budget):
        st = stage_times(table, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("offloaded-optimizer",),
                         remats=(False,), variants=("",), kept=(), offload_acts=False)
        return st, st.options[0][int(st.option[0, first, last, 0])]

    st, way = chosen(np.inf)
    assert not any(o.offload_params for o in st.options[0]) and way == plain
    _, f0, m0 = (x[first, last] for x in stage_ranges(table, plain, 4, boundary, link))
    _, f1, m1 = (x[first, last] for x in stage_ranges(table, hosted, 4, boundary, link))
    peak = update_peak(table, hosted)[first, last]
    budget = max(f1 + q * m1, peak) * 1.001
    assert budget < f0 + q * m0
    st, way = chosen(budget)
    assert way == hosted and st.times[0, first, last, 0] < np.inf


def test_a_stage_keeping_its_masters_away_is_recorded_and_runs_so():
    stage = PipelineStage(state_layout="offloaded-optimizer", remat=False, offloaded_params=True)
    assert stage_way(stage) == "offloaded-optimizer+params"
    again = PipelineStage.from_json(stage.to_json(), lambda d: None)
    assert again.offloaded_params is True
    skip_if_fewer_devices(8)
    from planner.core.mesh import MeshSpec
    planned = types.SimpleNamespace(
        layers=("blocks_0",), devices=(0, 1), mesh=MeshSpec((2,), ("x",)), specs={}, remat=False, data_axes=("x",),
        state_layout="offloaded-optimizer", kept_layers=0, offloaded_activations=False, offloaded_params=True)
    pp = types.SimpleNamespace(num_microbatches=2, schedule="1f1b", stages=[planned])
    step = PipelinedStep.from_plan(lambda p, b: 0.0, None, pp, jax.devices()[:2])
    (layout,) = step.layouts
    assert layout.offload_params and layout.offload_optimizer and layout.shard_optimizer
    with pytest.raises(InvalidArgumentError, match="offload_optimizer"):
        dataclasses.replace(layout, offload_optimizer=False)


def test_what_a_stage_keeps_in_host_memory_fits_its_share_of_the_host(table):
    """A way keeping values in host memory fits only where they fit the device's share of its
    host's memory (`Hardware.host_memory_per_device`, `stage_cost.host_ranges`): the offloaded
    optimizer state, and the master parameters where they wait there too. A host just large enough
    for the plain offloaded state keeps the cell; one a little smaller leaves no way of that layout."""
    L = table.layers.num_layers
    boundary, first, last = np.zeros(L), 1, 4
    rows = [table.cost(l, 0) for l in range(L)]
    plain = StageOption(0, "offloaded-optimizer", False)
    hosted = dataclasses.replace(plain, offload_params=True)
    need = sum(r.opt_host_bytes for r in rows[first:last + 1])
    fixed, per_mb = host_ranges(table, plain)
    assert need > 0 and fixed[first, last] == pytest.approx(need, rel=1e-12) and not per_mb.any()
    masters = sum(r.master_bytes for r in rows[first:last + 1])
    assert host_ranges(table, hosted)[0][first, last] == pytest.approx(need + masters, rel=1e-12)
    assert host_ranges(table, StageOption(0, "plan", False)) is None
    acts = host_ranges(table, StageOption(0, "plan", False, offload_acts=True))  # per microbatch in flight
    assert not acts[0].any() and acts[1][first, last] == pytest.approx(sum(r.act_bytes for r in rows[first:last + 1]))
    n = table.cluster.hardware.devices_per_host

    def cell(host_bytes_per_device):
        hw = dataclasses.replace(table.cluster.hardware, host_memory_bytes=host_bytes_per_device * n)
        small = dataclasses.replace(table, cluster=dataclasses.replace(table.cluster, hardware=hw))
        st = stage_times(small, [(1, 4)], [[0]], 8, "gpipe", np.inf, boundary, layouts=("offloaded-optimizer",),
                         remats=(False,), variants=("",), kept=(), offload_acts=False)
        return st.times[0, first, last, 0]

    assert np.isfinite(cell(need * 1.001)) and not np.isfinite(cell(need * 0.999))


def test_masters_kept_away_are_weighed_beside_offloaded_activations(table):
    """Master parameters in host memory are weighed beside every way of the offloaded layout that
    runs but does not fit, here a stage offloading its activations: under a budget that neither
    lever alone meets (the masters with the activations of 8 microbatches on the device, or the
    activations offloaded with the masters there), the cell takes both."""
    L = table.layers.num_layers
    link, boundary = boundary_link(table.cluster), np.zeros(L)
    first, last, q = 1, 4, 8
    masters = StageOption(0, "offloaded-optimizer", False, offload_params=True)
    acts = StageOption(0, "offloaded-optimizer", False, offload_acts=True)
    both = dataclasses.replace(acts, offload_params=True)

    def need(opt):
        _, fixed, per_mb = (x[first, last] for x in stage_ranges(table, opt, 4, boundary, link))
        return max(fixed + q * per_mb, update_peak(table, opt)[first, last])

    budget = need(both) * 1.001
    assert budget < min(need(masters), need(acts))
    st = stage_times(table, [(1, 4)], [[0]], q, "gpipe", budget, boundary, layouts=("offloaded-optimizer",),
                     remats=(False,), variants=("",), kept=(), offload_acts=True)
    assert st.options[0][int(st.option[0, first, last, 0])] == both and np.isfinite(st.times[0, first, last, 0])
