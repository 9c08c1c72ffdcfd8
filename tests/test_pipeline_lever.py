"""Pipeline stages weighed by default (`PlanOptions.pipeline=None`, `planner.planning.pipeline_lever`):
on a target of several hosts, for a step proven microbatch-invariant whose layers are not scanned,
the stage search is weighed against the single-step plan and the faster kept; elsewhere it is not
weighed, and the plan says why."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import planner
from planner import cli
from planner.core.options import PlanOptions
from planner.graph.trace import trace
from planner.planning.pipeline_lever import why_not_weighed
from tests.conftest import skip_if_fewer_devices
from tests import mlp_pipeline
from tests.helpers import assert_first_step_close
from zoo import get_model

# A slow network between the two hosts, so that stages beat splitting every layer across them.
SLOW = ["--cluster", "2x4:v100", "--inter-host", "1Gbit", "--quiet"]


def _planned(capsys, tmp_path, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    assert cli.main(["plan", "--model", "gpt-tiny", *SLOW, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_the_cli_weighs_stages_by_default_on_several_hosts_and_keeps_the_faster(capsys, tmp_path):
    """No flag: the stages win on a slow inter-host link, and the default plan is no slower than
    either the single step alone (--pipeline off) or the stage search alone (--pipeline on)."""
    default, text = _planned(capsys, tmp_path, "default")
    off, off_text = _planned(capsys, tmp_path, "off", "--pipeline", "off")
    on, _ = _planned(capsys, tmp_path, "on", "--pipeline", "on")
    step = {k: d["predicted"]["step_time_s"] for k, d in (("default", default), ("off", off), ("on", on))}
    assert len(default["stages"]) >= 2 and step["default"] < step["off"], step
    assert step["default"] <= step["on"] * (1 + 1e-9), step
    assert "Pipeline stages" in text and "used:" in text
    assert "Pipeline stages" not in off_text and len(off["stages"]) <= 1
    # the single-step plan it was weighed against is recorded beside the pipeline
    assert default["pipeline"]["single_stage_step_time_s"] == pytest.approx(step["off"], rel=1e-9)


def test_one_host_weighs_no_stages(capsys):
    assert cli.main(["plan", "--model", "gpt-tiny", "--cluster", "1x8:v100", "--quiet"]) == 0
    assert "Pipeline stages" not in capsys.readouterr().out


def _batch_norm_step(params, batch):
    def loss(p):
        h = batch["x"] @ p["w"]
        h = (h - h.mean(0)) / (h.std(0) + 1e-5)  # a batch statistic: examples mixed
        return jnp.mean((h @ p["v"] - batch["y"]) ** 2)

    l, g = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), l


def test_stages_are_not_weighed_for_a_step_mixing_examples_or_a_scanned_stack():
    budget = PlanOptions(memory_budget=16e9)
    params = {"w": jnp.ones((16, 16)), "v": jnp.ones((16, 4))}
    batch = {"x": jnp.ones((8, 16)), "y": jnp.ones((8, 4))}
    why = why_not_weighed(trace(_batch_norm_step, params, batch), budget)
    assert why is not None and "microbatch-invariant" in why
    scanned = get_model("llama-tiny", scan_layers=True)
    graph = trace(scanned.train_step, scanned.abstract_state(), scanned.abstract_batch())
    assert "scans its layers" in why_not_weighed(graph, budget)
    unrolled = get_model("llama-tiny", scan_layers=False)
    graph = trace(unrolled.train_step, unrolled.abstract_state(), unrolled.abstract_batch())
    assert why_not_weighed(graph, budget) is None
    assert "was asked for" in why_not_weighed(graph, PlanOptions(memory_budget=16e9, pipeline=False))
    assert why_not_weighed(graph, PlanOptions()) is None  # no budget: the stages fit the device memory


def test_plan_parallel_weighs_stages_on_a_cluster_and_runs_them():
    """The decorator on a two-host cluster with a slow link: the stages are kept, and running them
    computes the plain step (first-step parameters and loss as `jax.jit`'s)."""
    skip_if_fewer_devices(8)
    params, opt_state, x, y = mlp_pipeline.inputs()
    planned = planner.plan_parallel(mlp_pipeline.step, hardware="2x4:v100", inter_host="1Gbit")
    plan = planned.plan(params, opt_state, x, y)
    assert len(plan.stages) >= 2 and plan.pipeline.single_stage_step_time_s > plan.prediction.step_time_s
    new_params, new_opt, l = planned(params, opt_state, x, y)
    ref_params, ref_opt, ref_l = jax.jit(mlp_pipeline.step)(params, opt_state, x, y)
    assert_first_step_close(lambda p, b: mlp_pipeline.loss(p, *b), mlp_pipeline.OPT,
                            {"params": params, "opt_state": opt_state}, (x, y),
                            {"params": new_params, "opt_state": new_opt}, {"loss": l},
                            {"params": ref_params, "opt_state": ref_opt}, {"loss": ref_l},
                            train_step=lambda s, b: mlp_pipeline.step(s["params"], s["opt_state"], *b))


def test_a_hand_pipeline_of_a_scanned_zoo_model_is_built_unrolled(capsys):
    """`planner plan --baseline NAME+ppN` splits the zoo's scanned Llama into stages of whole
    layers, as --pipeline and `planner compare` do (a stage holds whole leaves)."""
    assert cli.main(["plan", "--model", "llama-tiny", "--cluster", "2x4:v100", "--batch", "4", "--seq", "32",
                     "--baseline", "megatron-tp+pp2"]) == 0
    out = capsys.readouterr().out
    assert "layers unrolled for pipelining" in out and "scaniter" not in out


def test_compare_weighs_stages_beside_pipeline_baselines_on_several_hosts(capsys, tmp_path):
    """`planner compare` beside a pipeline baseline on a --cluster of several hosts: the planner's
    row weighs its stage search too, so it is no slower than the pipeline baseline (its single
    step on the slow link alone was several times slower) and the report holds its stages; beside
    single-mesh baselines only, the row stays one mesh."""
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", "--model", "gpt-tiny", *SLOW, "--mesh", "2x4", "--baselines", "dp,megatron-tp+pp2",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows = {r["name"]: r["step_time_s"] for r in data["context"]["comparison"]["rows"]}
    assert rows["planner"] <= min(rows["dp"], rows["megatron-tp+pp2"]) * (1 + 1e-9), rows
    assert len(data["stages"]) >= 2 and "Pipeline stages of the planner's row" in text
    assert data["pipeline"]["single_stage_step_time_s"] > rows["megatron-tp+pp2"]  # what the row was before
    assert cli.main(["compare", "--model", "gpt-tiny", *SLOW, "--mesh", "2x4", "--baselines", "dp"]) == 0
    assert "Pipeline stages" not in capsys.readouterr().out


def test_python_compare_weighs_stages_beside_pipeline_baselines_on_several_hosts():
    """`planner.compare` as `planner compare`: beside a pipeline baseline on a cluster of several
    hosts (`hardware="HxD:preset"`) its planner row weighs the stage search too, no slower than that
    baseline, where its plan on the mesh alone was slower (the CLI test above checks that beside
    single-mesh baselines only the row stays on the mesh; both run `compose` with or without a
    stage search)."""
    skip_if_fewer_devices(8)
    b = get_model("gpt-tiny")
    args = (b.abstract_state(), b.abstract_batch())
    c = planner.compare(b.train_step, *args, baselines=("megatron-tp+pp2",), mesh="2x4", hardware="2x4:v100",
                        inter_host="1Gbit")
    rows = {n: p.prediction.step_time_s for n, p in c.others}
    assert set(rows) == {"megatron-tp+pp2"}, c.skipped
    assert c.plan.prediction.step_time_s <= rows["megatron-tp+pp2"] * (1 + 1e-9), (c.plan.prediction.step_time_s, rows)
    assert len(c.plan.stages) >= 2
    assert c.plan.pipeline.single_stage_step_time_s > rows["megatron-tp+pp2"]  # the mesh's plan alone lost
