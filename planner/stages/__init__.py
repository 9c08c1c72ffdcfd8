"""Inter-op planning (pipeline stages by Alpa's dynamic program) and the pipeline runtime.

    pp = plan_pipeline(train_step, (state, batch), make_cluster(8, 8, "v100", inter_host_gbit=25),
                       PlanOptions(pipeline="auto"))
    step = PipelinedStep.from_plan(loss_fn, optimizer, pp)
    state, metrics = step(state, batch)

Modules: `clustering` (ops -> layers), `submesh` (cluster, submesh shapes, logical meshes),
`stage_cost` (per-layer intra-op plans -> stage latency and memory), `dp` (the inter-op DP),
`inter_op` (the planning driver), `schedule` (GPipe / 1F1B), `step` (the plain train step, marked),
`planned` (the bridge to `planner.Plan` and `plan_parallel`; `run_plan`), `derived` (loss and update read
from an unmarked step). The runtime: `layout` (where each
stage runs), `partition` (ops, parameters and values per stage), `programs` (per-stage jitted
programs), `opt_state` (optimizer state per stage), `runtime` (`PipelinedStep`, the schedule run).
"""
from planner.stages.clustering import Layers, cluster_layers
from planner.stages.dp import DPResult, StageChoice, bubble_fraction, pipeline_dp, pipeline_latency
from planner.stages.inter_op import PipelinePlan, StagePlan, plan_pipeline
from planner.stages.planned import PipelineRunner, cluster_for, plan_stages, plan_with_stages, run_plan, to_plan
from planner.stages.runtime import PipelinedStep, StageLayout, even_layouts, layer_names
from planner.stages.schedule import dispatch_order, stage_tasks
from planner.stages.step import pipelinable
from planner.stages.submesh import logical_meshes, make_cluster, submesh_shapes

__all__ = [
    "DPResult", "Layers", "PipelinePlan", "PipelineRunner", "PipelinedStep", "StageChoice", "StageLayout",
    "StagePlan", "bubble_fraction", "cluster_for", "cluster_layers", "dispatch_order", "even_layouts", "layer_names",
    "logical_meshes", "make_cluster", "pipelinable", "pipeline_dp", "pipeline_latency", "plan_pipeline", "plan_stages",
    "plan_with_stages", "run_plan", "stage_tasks", "submesh_shapes", "to_plan",
]
