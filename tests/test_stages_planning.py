"""Inter-op planning end to end on abstract models: when to pipeline, where stages go, what the plan records."""
from __future__ import annotations

import json
import math

import pytest

from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from zoo import get_model
from planner.core.options import PlanOptions
from planner.stages.inter_op import plan_pipeline
from planner.stages.microbatches import microbatch_counts
from planner.stages.submesh import make_cluster


def _plan(name: str, cluster, ndim: int = 1, **options):
    b = get_model(name)
    return plan_pipeline(b.train_step, (b.abstract_state(), b.abstract_batch()), cluster,
                         PlanOptions(**options), max_mesh_ndim=ndim)


def test_uniform_fast_cluster_keeps_a_small_gpt_in_one_stage():
    # GPT-2 small (124M) on one 8-GPU NVLink node: pipelining only adds a bubble.
    pp = _plan("gpt2-small", make_cluster(1, 8, "a100"), pipeline="auto")
    assert pp.num_stages == 1
    assert pp.stages[0].submesh == (1, 8) and pp.stages[0].devices == tuple(range(8))
    assert pp.num_microbatches == 1 and pp.bubble_fraction == 0.0
    assert pp.step_time_s == pytest.approx(pp.single_stage_time_s)
    assert all(t > pp.step_time_s for b, t, s in pp.candidates if s > 1)
    # The single stage competes at the price of what runs it: the whole program's intra-op plan on
    # that mesh (whose gradient reduction hides behind the backward), not the per-layer tables' sum.
    from planner.graph.trace import trace
    from planner.search.mesh_plan import make_plan

    b = get_model("gpt2-small")
    st = pp.stages[0]
    whole = make_plan(trace(b.train_step, b.abstract_state(), b.abstract_batch()), st.mesh,
                      PlanOptions(memory_budget=make_cluster(1, 8, "a100").hardware.memory_bytes,
                                  inter_host_axes=st.host_axes, hardware=make_cluster(1, 8, "a100").hardware))
    assert pp.step_time_s == pytest.approx(whole.prediction.step_time_s, rel=1e-9)


def test_slow_host_links_pipeline_along_host_boundaries():
    # Four hosts of two GPUs joined by 10 Gbit/s: collectives across hosts are ruinous, sending one
    # activation per microbatch between consecutive hosts is cheap.
    cluster = make_cluster(4, 2, "a100", inter_host_gbit=10)
    pp = _plan("gpt2-small", cluster, pipeline="auto")
    assert pp.num_stages > 1
    assert pp.step_time_s < pp.single_stage_time_s
    for st in pp.stages:
        assert st.devices[0] % 2 == 0 and len(st.devices) % 2 == 0, st.devices  # whole hosts
    covered = [d for st in pp.stages for d in st.devices]
    assert sorted(covered) == list(range(8))
    names = [n for st in pp.stages for n in st.layers]
    assert names == list(pp.layer_names) and names[0] == "pre" and names[-1] == "post"
    assert 0.0 < pp.bubble_fraction < 1.0
    # What the plan records, in words and in JSON.
    text = pp.summary()
    assert "stage 0" in text and f"{pp.num_microbatches} microbatches" in text and "bubble" in text
    info = json.loads(json.dumps(pp.facts().to_json()))
    assert info["schedule"] == "1f1b" and info["num_microbatches"] == pp.num_microbatches
    assert info["bubble_fraction"] == pytest.approx(pp.bubble_fraction)
    stages = json.loads(json.dumps([s.to_json() for s in pp.stage_records()]))
    assert [s["layers"] for s in stages] == [list(st.layers) for st in pp.stages]
    assert all(s["submesh"] == [1, 2] or s["submesh"][1] == 2 for s in stages)
    assert all(set(s) >= {"layers", "submesh", "mesh", "devices", "shardings", "inflight_microbatches"}
               for s in stages)
    assert any("['params']['blocks_0']" in p for p in stages[0]["shardings"])
    # Where no single stage fits, the ranking says how far that was searched.
    import dataclasses
    import math

    from planner.present.ranking import _no_single

    assert info["planning"]["single_stage_mesh_search"] in (True, False)
    unfit = dataclasses.replace(pp, single_stage_time_s=math.inf, single_stage_time_unconstrained_s=2 * pp.step_time_s,
                                planning=dataclasses.replace(pp.planning, single_stage_mesh_search=False))
    assert "per-layer tables" in _no_single(unfit) and "2.0x this pipeline" in _no_single(unfit)
    searched = dataclasses.replace(unfit, planning=dataclasses.replace(pp.planning, single_stage_mesh_search=True))
    assert _no_single(searched) == "does not fit the budget on any mesh shape searched"


def test_forced_pipeline_schedule_and_microbatches():
    cluster = make_cluster(2, 4, "a100")
    pp = _plan("gpt-small-test", cluster, pipeline=True, num_microbatches=4, schedule="gpipe")
    assert pp.num_stages >= 2 and pp.num_microbatches == 4 and pp.schedule == "gpipe"
    assert all(st.inflight == 4 for st in pp.stages)  # GPipe keeps every microbatch's activations
    assert [c[0] for c in pp.candidates] == [4]
    one_f = _plan("gpt-small-test", cluster, pipeline=True, num_microbatches=4)
    assert [st.inflight for st in one_f.stages] == [min(4, one_f.num_stages - k) for k in range(one_f.num_stages)]


def test_microbatch_counts_and_errors():
    assert microbatch_counts(8, None, 2) == (8, 2)  # a limit spreads the counts in log scale
    assert microbatch_counts(12, None, 3) == (12, 6, 2)
    assert microbatch_counts(1024, None, 4) == (1024, 128, 16, 2)
    assert microbatch_counts(8, None, 5) == (8, 4, 2)
    assert microbatch_counts(12, None) == (12, 6, 4, 3, 2)  # every divisor, not only powers of two
    assert microbatch_counts(1024, None) == tuple(2**k for k in range(10, 0, -1))
    assert microbatch_counts(8, 2, 2) == (2,)
    with pytest.raises(InvalidArgumentError, match="does not divide"):
        microbatch_counts(8, 3, 2)
    with pytest.raises(InfeasiblePlanError, match="memory budget"):
        _plan("gpt-small-test", make_cluster(1, 2, "a100"), pipeline=True, memory_budget=1e3)


def test_gpt39b_on_alpa_testbed_pipelines_along_hosts():
    """GPT-39B (abstract) on 8 hosts x 8 V100-16GB with 25 Gbit/s between hosts, as Alpa benchmarked it.

    1-D logical meshes, a fixed B and half the depth (24 of 48 layers: the same layer widths and
    still no single-stage fit) keep this test quick; experiments/bench_pipeline.py plans the full
    model and search (2-D meshes, B chosen).
    """
    b = get_model("gpt3-39b", dtype="bfloat16", layers=24)
    cluster = make_cluster(8, 8, "v100-16gb", inter_host_gbit=25)
    pp = plan_pipeline(b.train_step, (b.abstract_state(), b.abstract_batch()), cluster,
                       PlanOptions(pipeline="auto", num_microbatches=8), max_mesh_ndim=1)
    assert pp.num_stages > 1
    for st in pp.stages:  # every stage is a whole number of hosts
        assert st.devices[0] % 8 == 0 and len(st.devices) % 8 == 0, st.devices
        assert st.memory_bytes <= cluster.hardware.memory_bytes
    assert pp.step_time_s < pp.single_stage_time_s  # the single stage does not even fit (infinite)
    assert pp.step_time_s < pp.single_stage_time_unconstrained_s
    assert pp.planning.distinct_layers == 3 and pp.planning.layers == 26


def test_pipeline_auto_single_stage_is_the_mesh_search_best():
    """The stage tables see the whole cluster as one logical mesh (here 1-D: `max_mesh_ndim=1`); the
    single stage competes as the best plan of every mesh shape of the cluster (what `planner plan
    --pipeline off` finds), and that plan is the one kept to run."""
    from planner.graph.trace import trace
    from planner.search.candidates import candidate_meshes
    from planner.search.meshes import search_meshes
    from planner.stages.submesh import effective_hardware

    cluster = make_cluster(1, 8, "a100")
    pp = _plan("gpt2-small", cluster, ndim=1, pipeline="auto")
    b = get_model("gpt2-small")
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    best = search_meshes(graph, candidate_meshes(8), PlanOptions(memory_budget=cluster.hardware.memory_bytes,
                                                                 hardware=effective_hardware(cluster)),
                         devices_per_host=8)[0]
    assert best.mesh.shape == (2, 4)  # not the tables' 1-D mesh
    assert pp.num_stages == 1 and pp.stages[0].mesh == best.mesh
    assert pp.step_time_s == pytest.approx(best.plan.prediction.step_time_s, rel=1e-9)
    assert pp.single_stage_plan[0].mesh == pp.stages[0].mesh


def test_microbatch_counts_the_step_cannot_run_are_skipped_in_one_line(caplog):
    """A step that does not trace on small microbatches (an MoE routing tokens in groups longer than
    a microbatch: 8 tokens per row, groups of 16) loses those counts, with a warning, instead of
    stopping the search with a traceback from inside the model; a fixed count it cannot run is a
    one-line error."""
    import logging

    b = get_model("moe-tiny", batch=4, seq=8, group_size=16)
    args = (b.abstract_state(), b.abstract_batch())
    with caplog.at_level(logging.WARNING, logger="planner"):
        pp = plan_pipeline(b.train_step, args, make_cluster(1, 2, "cpu"), PlanOptions(pipeline=True),
                           max_mesh_ndim=1)
    assert pp.num_microbatches == 2 and [c[0] for c in pp.candidates] == [2]
    assert any("B=4: the step does not trace on 4 microbatches of 1 rows (TypeError" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(InvalidArgumentError, match=r"^the step does not trace on 4 microbatches of 1 rows "
                                                   r"\(TypeError: [^\n]*\); no microbatch count tried traces \(4\)$"):
        plan_pipeline(b.train_step, args, make_cluster(1, 2, "cpu"), PlanOptions(pipeline=True, num_microbatches=4),
                      max_mesh_ndim=1)


def test_pipeline_search_prices_the_runtimes_per_microbatch_reduction(caplog):
    """The runtime reduces a data-parallel stage's gradients once per step only where the loss
    traces on one replica's share of a microbatch (`stage_records.set_replicas`). An MoE
    routing 32-token groups traces on 8-row microbatches (64 tokens) but not on a quarter of one:
    the search's chosen pipeline prices each stage split 4 ways as the runtime runs it, its
    reduction in every microbatch (in the stage time, none once per step), and says so; the
    prediction is still the pipeline latency of the stage times plus the once-per-step part."""
    import logging

    from planner.cost_model.cluster import Cluster
    from planner.stages.dp import pipeline_latency

    b = get_model("moe-tiny", batch=16, seq=8, group_size=32)
    args = (b.abstract_state(), b.abstract_batch())
    with caplog.at_level(logging.WARNING, logger="planner"):
        pp = plan_pipeline(b.train_step, args, Cluster.parse("2x4:a100"),
                           PlanOptions(pipeline=True, num_microbatches=2))
    named = pp.planning.grad_sync_per_microbatch
    assert named and all("split 4 ways" in line for line in named)
    ways = [math.prod(st.mesh.shape[st.mesh.axis_names.index(a)] for a in st.data_axes) for st in pp.stages]
    fallback = {int(line.split(":")[0].split()[1]) for line in named}
    assert fallback == {k for k, w in enumerate(ways) if w == 4}
    assert all(pp.stages[k].grad_sync_s == 0.0 for k in fallback)
    assert any(w == 2 and st.grad_sync_s > 0 for w, st in zip(ways, pp.stages))  # a 2-way share traces
    assert pp.step_time_s == pytest.approx(pipeline_latency([st.time_s for st in pp.stages], 2)
                                           + max(st.grad_sync_s + st.apply_s for st in pp.stages), rel=1e-12)
    assert sum("every microbatch" in r.getMessage() for r in caplog.records) == 1
    # Searching every count, candidates are compared re-priced: the answer is no slower than the
    # 2-microbatch pipeline as the runtime runs it, and priced as the runtime runs it too.
    free = plan_pipeline(b.train_step, args, Cluster.parse("2x4:a100"), PlanOptions(pipeline=True),
                         microbatch_limit=3)  # 16, 8 and 2 microbatches
    assert free.step_time_s <= pp.step_time_s * (1 + 1e-12)
    assert free.step_time_s == pytest.approx(pipeline_latency([st.time_s for st in free.stages], free.num_microbatches)
                                             + max(st.grad_sync_s + st.apply_s for st in free.stages), rel=1e-12)


def test_counts_of_larger_microbatches_are_skipped_once_one_fits_nothing():
    """gpt-tiny, batch 16 on 1x4 with a 1.2 MB budget: 4 microbatches of 4 rows fit no pipeline in any
    layout, so 2 microbatches of 8 rows are not planned, and planned alone they fit nothing either;
    the search keeps its best count and says how each size was traced."""
    b = get_model("gpt-tiny", batch=16)
    args = (b.abstract_state(), b.abstract_batch())
    cluster = make_cluster(1, 4, "a100")
    pp = plan_pipeline(b.train_step, args, cluster, PlanOptions(pipeline=True, memory_budget=1.2e6), max_mesh_ndim=1)
    assert pp.planning.larger_microbatches_skipped == (2,)
    assert [c for c, t, _ in pp.candidates if not math.isfinite(t)] == [4]
    assert pp.num_microbatches == 8 and pp.memory_bytes_per_device <= 1.2e6
    assert pp.planning.shape_family == "traced once"
    with pytest.raises(InfeasiblePlanError):
        plan_pipeline(b.train_step, args, cluster, PlanOptions(pipeline=True, num_microbatches=2, memory_budget=1.2e6),
                      max_mesh_ndim=1)
