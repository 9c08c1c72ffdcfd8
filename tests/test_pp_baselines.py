"""Pipeline baselines (`evaluate(..., baseline="NAME+ppN")`, planner/planning/evaluate.py and
planner/stages/fixed_pipeline.py) and pins with pipeline stages."""
from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

import planner
from planner.configs.baselines import baseline_specs, batch_ways, parse_baseline
from planner.planning.evaluate import evaluate
from planner.graph.trace import trace
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.pipeline_records import HandLayoutCounts
from planner.configs.pins import stage_pins
from planner.stages.submesh import make_cluster
from planner.emit.pipeline.planned import run_plan
from planner.stages.clustering import cluster_layers
from planner.stages.fixed_pipeline import even_stage_ranges, even_submesh
from planner.stages.inter_op import plan_pipeline
from planner.stages.submesh import logical_meshes
from tests.conftest import skip_if_fewer_devices
from tests.helpers import assert_first_step_close
from zoo import get_model, make_optimizer


def _abstract(b):
    return b.abstract_state(), b.abstract_batch()


def test_megatron_tp_pp2_runs_equal_to_the_unsharded_step():
    """gpt-tiny, megatron-tp+pp2 on 8 CPU devices: two stages of 4 devices (2x2 stage meshes), the
    embedding with blocks_0, blocks_1 with the head; tensor parallelism over every axis of a stage
    (one host); run from its saved JSON by run_plan, equal to the unsharded step."""
    skip_if_fewer_devices(8)
    b = get_model("gpt-tiny", batch=4, seq=8, d_model=32, vocab=64)
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    plan = evaluate(b.train_step, state, batch, mesh="1x8", baseline="megatron-tp+pp2", hardware="cpu",
                    num_microbatches=2)
    assert plan.solver.configuration == "baseline megatron-tp+pp2"
    assert plan.pipeline.num_microbatches == 2 and plan.pipeline.num_stages == 2
    assert [st.layers for st in plan.stages] == [("pre", "blocks_0"), ("blocks_1", "post")]
    assert [st.devices for st in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [st.mesh.axis_names for st in plan.stages] == [("x", "y")] * 2
    query = "[0]['params']['blocks_1']['attn']['query']['kernel']"
    first, second = (dict(st.shardings) for st in plan.stages)
    assert second[query] == ((), (0, 1), ())  # column parallel: heads over (x, y)
    assert first["[0]['params']['wte']['embedding']"] == ((0, 1), ())  # vocab
    assert first["[1]['inputs']"] == ((), ())  # megatron-tp: batch replicated
    assert plan.prediction.bytes_moved_per_device > 0
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = run_plan(b.train_step, planner.Plan.from_json(plan.to_json()))(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)


def test_megatron_layout_across_hosts_and_even_stages():
    """As Megatron-LM lays out TP x PP x DP: stages over whole hosts, tensor parallelism on the axis
    inside a host, data parallelism across hosts (abstract: the 64x8 cluster of the SC21 paper)."""
    cluster = make_cluster(64, 8, "a100-80gb")
    shape = even_submesh(cluster, 2)
    assert shape == (32, 8)
    lm = logical_meshes(shape, cluster)[0]
    assert lm.mesh.shape == (32, 8) and lm.host_axes == (0,)
    b = get_model("gpt-tiny", heads=8, batch=64)
    flat = jax.tree_util.tree_flatten_with_path(_abstract(b))[0]
    paths, shapes = [jax.tree_util.keystr(p) for p, _ in flat], [x.shape for _, x in flat]
    specs = dict(zip(paths, baseline_specs("megatron-tp", paths, shapes, lm.mesh, lm.host_axes)))
    assert specs["[0]['params']['blocks_0']['attn']['query']['kernel']"] == P(None, "y", None)
    assert specs["[0]['params']['blocks_0']['mlp']['fc_out']['kernel']"] == P("y", None)
    assert specs["[1]['inputs']"] == P("x", None)
    assert batch_ways("megatron-tp", lm.mesh, lm.host_axes) == 32
    assert batch_ways("megatron-tp", lm.mesh) == 1  # one TP group over every axis: batch replicated
    assert even_submesh(make_cluster(1, 8), 4) == (1, 2)
    with pytest.raises(planner.InvalidArgumentError, match="does not split into 3 equal pipeline stages"):
        even_submesh(make_cluster(2, 8), 3)
    four = get_model("gpt-tiny", layers=4)
    layers = cluster_layers(trace(four.train_step, *_abstract(four)))
    assert even_stage_ranges(layers, 2) == ((0, 2), (3, 5))  # pre + 2 blocks | 2 blocks + post
    with pytest.raises(planner.InvalidArgumentError, match=r"the 4 layers blocks_0..blocks_3 do not split evenly "
                                                           r"into 3 pipeline stages"):
        even_stage_ranges(layers, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"baseline": "dp+pp4"}, r"the 2 layers blocks_0..blocks_1 do not split evenly into 4 pipeline stages"),
    ({"baseline": "dp+ppx"}, r"write the pipeline part as \+ppN"),
    ({"baseline": "ddp+pp2"}, r"unknown baseline 'ddp'"),
    ({"baseline": "dp+pp2", "pipeline_stages": 4}, "disagree"),
    ({"baseline": "dp+pp2", "num_microbatches": 8}, r"num_microbatches=8 gives microbatches of 1 that this "
                                                    r"configuration splits 4 ways"),
    ({"pins": {"x": P()}, "pipeline_stages": 2}, "goes with baseline="),
])
def test_pipeline_baseline_errors_are_one_line(kwargs, message):
    b = get_model("gpt-tiny")
    with pytest.raises(planner.InvalidArgumentError, match=message) as e:
        evaluate(b.train_step, *_abstract(b), mesh="1x8", hardware="cpu", **kwargs)
    assert "\n" not in str(e.value)
    assert parse_baseline("megatron-tp-sp+pp4") == ("megatron-tp-sp", 4)


def test_counts_whose_replica_share_does_not_trace_are_skipped(caplog):
    """megatron-tp+pp2 on 4 hosts x 2 devices splits each microbatch over 2 hosts; an MoE routing
    groups of 16 tokens (2 rows of 8) traces on 4 microbatches of 2 rows but not on one replica's
    share of 1 row, which the stage plans trace to accumulate gradients per replica (gshard-moe-1.3b
    on 128x8 stopped there with a traceback from inside the model): that count is skipped with a
    warning, and where no count is left (a fixed count; dp+pp2, 4 replicas) it is a one-line error.
    fsdp+pp2's replicas reduce gradients per microbatch (parameters split over the data axes): not
    traced per replica, its count stays."""
    import logging

    b = get_model("moe-tiny", batch=8, seq=8, group_size=16)
    with caplog.at_level(logging.WARNING, logger="planner"):
        plan = evaluate(b.train_step, *_abstract(b), baseline="megatron-tp+pp2", cluster="4x2:cpu")
    assert plan.pipeline.num_microbatches == 2
    assert [c.num_microbatches for c in plan.pipeline.candidates] == [2]
    assert any("B=4: the step does not trace on 4 microbatches of 2 rows split 2 ways (1 per data-parallel "
               "replica) (TypeError" in r.getMessage() for r in caplog.records)
    for base, B, message in (("megatron-tp+pp2", 4, "4 microbatches of 2 rows split 2 ways"),
                             ("dp+pp2", None, "2 microbatches of 4 rows split 4 ways")):
        with pytest.raises(planner.InvalidArgumentError, match=rf"^the step does not trace on {message} .*; "
                                                               rf"no microbatch count tried traces \({B or 2}\)$"):
            evaluate(b.train_step, *_abstract(b), baseline=base, cluster="4x2:cpu", num_microbatches=B)
    fsdp = evaluate(b.train_step, *_abstract(b), baseline="fsdp+pp2", cluster="4x2:cpu")
    assert fsdp.pipeline.num_microbatches == 2 and fsdp.prediction.step_time_s > 0


def test_tensor_parallel_degree_lays_stages_out_as_megatron():
    """tensor_parallel=T views each stage as a (devices / T, T) mesh, T inside a host; a degree that
    does not divide a host is a one-line error."""
    b = get_model("gpt-tiny", batch=16)
    kw = dict(baseline="megatron-tp+pp2", cluster="4x8:a100-80gb", num_microbatches=2, remat=True)
    plan = evaluate(b.train_step, *_abstract(b), tensor_parallel=2, **kw)
    assert [st.mesh for st in plan.stages] == [MeshSpec((8, 2), ("x", "y"))] * 2  # 2 hosts per stage
    assert plan.solver.configuration == "baseline megatron-tp+pp2 (tensor parallel 2)"
    with pytest.raises(planner.InvalidArgumentError, match="tensor_parallel=3 must be") as e:
        evaluate(b.train_step, *_abstract(b), tensor_parallel=3, **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(planner.InvalidArgumentError, match="are for pipeline baselines"):
        evaluate(b.train_step, *_abstract(b), mesh="1x8", baseline="dp", tensor_parallel=2)


def test_pins_apply_to_the_stage_holding_the_pinned_parameter():
    """A pin on blocks_0's MLP kernel fixes it on the stage that runs blocks_0 and nowhere else;
    an identical layer without the pin is planned on its own."""
    b = get_model("gpt-tiny")
    args = _abstract(b)
    fc_in = "[0]['params']['blocks_{}']['mlp']['fc_in']['kernel']"
    pp = plan_pipeline(b.train_step, args, make_cluster(1, 4, "cpu"), PlanOptions(pipeline=True, num_microbatches=2),
                       max_mesh_ndim=1, pins=stage_pins({"params/blocks_0/mlp/fc_in/kernel": P("x", None)}))
    holding = [st for st in pp.stages if "blocks_0" in st.layers]
    assert len(holding) == 1 and holding[0].specs[fc_in.format(0)] == ((0,), ())
    others = [st.specs[fc_in.format(1)] for st in pp.stages if fc_in.format(1) in st.specs]
    assert others and others[0] != ((0,), ())
    # Through the public API: pins with pipeline= are checked before anything is planned.
    for pins, message in (({"nothing/here": P()}, "pin 'nothing/here' matches no argument path"),
                          ({"blocks_0/mlp/fc_in/kernel": P("data")}, "names mesh axis 'data'; with pipeline stages")):
        with pytest.raises(planner.InvalidArgumentError, match=message):
            planner.plan(b.train_step, *args, mesh="1x8", pipeline=True, pins=pins)


def test_cli_plan_and_compare_with_pipeline_baselines(capsys):
    from planner import cli
    common = ["--model", "mlp-tiny", "--hardware", "cpu", "--microbatches", "2", "-q"]
    assert cli.main(["compare", "--mesh", "1x8", "--baselines", "dp,dp+pp2", *common]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.strip().split()[:1] in (["planner"], ["dp"],
                                                                                          ["dp+pp2"])]
    assert rows == ["planner", "dp", "dp+pp2"]
    assert cli.main(["plan", "--devices", "8", "--baseline", "dp+pp2", *common]) == 0
    assert "Your configuration: baseline dp+pp2, 2 even pipeline stages, dp pins in each" in capsys.readouterr().out
    for argv, message in ((["compare", "--mesh", "1x8", "--baselines", "dp+ppx"], "write the pipeline part as +ppN"),
                          (["plan", "--devices", "8", "--baseline", "dp+pp2", "--pin", "x=P()"], "drop --pin")):
        assert cli.main(argv + common) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_pipeline_search_pinned_to_a_baseline_predicts_what_the_baseline_predicts():
    """One code path: the planner's stage DP with every leaf pinned to megatron-tp (on each stage's
    mesh) picks the even split here, and then predicts exactly the pp baseline's step time."""
    from planner.planning.evaluate import pipeline_baseline_pins
    from planner.stages.fixed_pipeline import fixed_pipeline
    b = get_model("gpt-tiny")
    args, cluster = _abstract(b), make_cluster(1, 4, "cpu")
    options = PlanOptions(pipeline=True, num_microbatches=2)
    searched = plan_pipeline(b.train_step, args, cluster, options, max_mesh_ndim=1,
                             pins=pipeline_baseline_pins("megatron-tp"))
    fixed = fixed_pipeline(b.train_step, args, cluster, options, 2, max_mesh_ndim=1,
                           pins=pipeline_baseline_pins("megatron-tp"))
    assert [(s.layer_range, s.submesh) for s in searched.stages] == [((0, 1), (1, 2)), ((2, 3), (1, 2))]
    assert [(s.layer_range, s.submesh) for s in fixed.stages] == [((0, 1), (1, 2)), ((2, 3), (1, 2))]
    assert [s.time_s for s in fixed.stages] == [s.time_s for s in searched.stages]
    assert fixed.step_time_s == searched.step_time_s


def test_pipeline_search_holds_the_hand_layouts_as_points():
    """The stage tables hold each layer planned in the megatron-tp and fsdp layouts beside its own
    (fastest) plan, so a `NAME+ppN` baseline is one of the pipelines the search prices: under a
    budget where the fastest per-layer plans only fit with recomputation or sharded state (or not
    at all: at 1.0 MB the search without those layouts found no pipeline for fsdp+pp2's two
    microbatches), the search's best pipeline at the baseline's microbatch count is no slower than
    the baseline, and it names the hand layout a stage's layers run in."""
    b = get_model("gpt-tiny")
    args, hw = _abstract(b), "2x4:a100-80gb"
    cluster = make_cluster(2, 4, "a100-80gb")
    graph = trace(b.train_step, *args)
    ways = set()
    for budget, name in ((1.0e6, "fsdp"), (1.0e6, "megatron-tp"), (1.6e6, "megatron-tp")):
        base = evaluate(b.train_step, *args, baseline=f"{name}+pp2", cluster=hw, memory_budget=budget)
        assert base.pipeline.planning.fits_memory in (None, True)
        B = base.pipeline.num_microbatches
        searched = plan_pipeline(b.train_step, args, cluster,
                                 PlanOptions(pipeline=True, num_microbatches=B, memory_budget=budget), full_graph=graph)
        assert searched.step_time_s <= base.prediction.step_time_s * (1 + 1e-9), (budget, name)
        assert max(s.memory_bytes for s in searched.stages) <= budget
        assert searched.planning.hand_layout_counts == HandLayoutCounts((B,), ())  # memory binds
        ways |= {s.layer_plans for s in searched.stages}
    assert ways & {"megatron-tp", "fsdp"}
    # Where memory does not bind, the layers' own plans are the fastest: the hand layouts are not priced.
    roomy = plan_pipeline(b.train_step, args, cluster, PlanOptions(pipeline=True, num_microbatches=2,
                                                                   memory_budget=1e9), full_graph=graph)
    assert roomy.planning.hand_layout_counts == HandLayoutCounts((), (2,))
    assert {s.layer_plans for s in roomy.stages} == {"planned"}


@pytest.mark.parametrize("written", ["pipelinable", "plain step"])
def test_a_stage_in_a_hand_layout_runs_equal_to_the_unsharded_step(written):
    """A pipeline whose stages run their layers in the megatron-tp layout (the search's choice
    under a 1.4 MB budget on 2 hosts x 4 devices, with its optimizer state kept on the host, and a
    second stage that splits its optimizer state over its data axes) lowers, runs and matches the
    unsharded step through the decorator: with its optimizer given (`pipelinable`), and as a plain
    train step, whose update ops the stages run (`stages.derived.GraphUpdate`; the host-kept
    state's update one parameter at a time, as with the optimizer)."""
    skip_if_fewer_devices(8)
    from planner.stages.step import pipelinable
    b = get_model("gpt-tiny")
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    fn = pipelinable(b.loss_fn, opt) if written == "pipelinable" else b.train_step
    step = planner.plan_parallel(fn, mesh=(2, 4), inter_host_axes=(0,),
                                 hardware="a100-80gb", pipeline=True, num_microbatches=2, memory_budget=1.4e6)
    plan = step.plan(state, batch)
    assert "megatron-tp" in {st.layer_plans for st in plan.stages}
    assert {"offloaded-optimizer", "sharded-optimizer"} <= {st.state_layout for st in plan.stages}
    assert "megatron-tp:" in plan.summary()
    new_state, metrics = step(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)


def test_megatron_tp_pp2_runs_the_scanned_llama_equal_to_the_unsharded_step():
    """The zoo's Llama (layers scanned over stacked leaves), megatron-tp+pp2 on 8 CPU devices: the
    scan's two iterations in two stages (a stage owns whole stacked leaves, so the first holds both
    layers' weights; WORKSPACE "Scanned models pipeline badly"); run from its saved JSON, equal to
    the unsharded step."""
    skip_if_fewer_devices(8)
    b = get_model("llama-tiny", batch=4, seq=8, d_model=32, mlp_dim=64)
    assert b.config.scan_layers
    opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    plan = evaluate(b.train_step, state, batch, mesh="1x8", baseline="megatron-tp+pp2", hardware="cpu",
                    num_microbatches=2)
    assert [st.layers for st in plan.stages] == [("pre", "scaniter_0"), ("scaniter_1", "post")]
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = run_plan(b.train_step, planner.Plan.from_json(plan.to_json()))(state, batch)
    assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state, ref_metrics,
                            train_step=b.train_step)
