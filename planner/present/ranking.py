"""The ranking of planned meshes and the context block saved beside a plan (`planner plan`).

Rows and context are plain JSON data: `format_ranking` prints them now, and `planner plan --from`
or `--html` print them again from the saved file.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from planner.cost_model import Cluster, get_hardware
from planner.graph.ir import Graph
from planner.core.plan import Plan
from planner.present.report import PlanView, fmt_bytes, fmt_time, mfu
from planner.search.results import MeshResult
from planner.stages.pipeline_plan import PipelinePlan

Ranked = list[tuple[dict, Plan | None]]  # (ranking row, plan or None), best first


def hardware_record(hardware: Any) -> dict:
    """The facts of a hardware preset the views need (name, peak FLOP/s, memory, where its achieved
    rates come from)."""
    hw = get_hardware(hardware)
    return {"name": hw.name, "flops_f32": hw.flops_f32, "flops_bf16": hw.flops_bf16, "memory_bytes": hw.memory_bytes,
            "rates_source": hw.rates_source}


def _axes_text(names: Sequence[str], shape: Sequence[int], inter: Sequence[int]) -> str:
    return ", ".join(f"{n}={s}" + ("*" if i in inter else "") for i, (n, s) in enumerate(zip(names, shape)))


def _plan_row(plan: Plan, flops: Mapping[str, float], hardware: Mapping[str, float], devices: int) -> dict:
    p = plan.prediction
    return {"status": "ok", "stages": max(1, len(plan.stages)), "step_time_s": p.step_time_s,
            "memory_bytes_per_device": p.memory_bytes_per_device, "bytes_moved_per_device": p.bytes_moved_per_device,
            "mfu": mfu(flops, hardware, p.step_time_s, devices)}


def mesh_ranking(results: Sequence[MeshResult], flops: Mapping[str, float], hardware: Mapping[str, float]) -> Ranked:
    """One row per mesh of a `search_meshes` result, in its order."""
    out: Ranked = []
    for r in results:
        row = {"mesh": str(r.mesh), "axes": _axes_text(r.mesh.axis_names, r.mesh.shape, r.inter_host_axes),
               "inter_host_axes": list(r.inter_host_axes)}
        if r.plan is not None:
            row.update(_plan_row(r.plan, flops, hardware, r.mesh.size), plan_time_s=round(r.plan_time_s, 2))
        elif r.same_as is not None and r.error is None:
            row.update(status="same", note=f"the problem of mesh {r.same_as} with the axes permuted: not planned again")
        elif r.pruned is not None:
            row.update(status="pruned", note=r.pruned)
        elif r.over_budget and not getattr(r.error, "proven", True):  # the solver's limit stopped it
            need = r.min_memory_bytes
            row.update(status="undecided", memory_bytes_per_device=need,
                       note="no plan within the budget found within the solver limit"
                       + (f" (smallest found {fmt_bytes(need)})" if need else ""))
        elif r.over_budget:
            need = r.min_memory_bytes
            floor = r.lower_bound_bytes
            parts = ([f"needs >= {fmt_bytes(floor)}"] if floor else []) + (
                [f"smallest peak found {fmt_bytes(need)}"] if need else []) + (["not solved"] if r.over_bound else [])
            row.update(status="over budget", memory_bytes_per_device=need, note=", ".join(parts))
        else:
            row.update(status="unusable", note=str(r.error).split(";")[0])
        out.append((row, r.plan))
    return out


def pipeline_ranking(plan: Plan, pp: PipelinePlan, cluster: Cluster, flops: Mapping[str, float],
                     hardware: Mapping[str, float], plan_time_s: float) -> Ranked:
    """The pipeline plan's row; when several stages won, a second row gives the best single-stage time."""
    hosts, per_host = cluster.hosts, cluster.devices_per_host
    if pp.num_stages == 1:
        st = pp.stages[0]
        mesh_text, inter = str(st.mesh), list(st.host_axes)
        axes, note = _axes_text(st.mesh.axis_names, st.mesh.shape, inter), "single stage"
    else:
        mesh_text, inter = (f"{hosts}x{per_host}" if hosts > 1 else str(per_host)), []
        axes = f"{pp.num_stages} stages on submeshes " + ", ".join(f"{s.submesh[0]}x{s.submesh[1]}" for s in pp.stages)
        note = f"{pp.schedule}, {pp.num_microbatches} microbatches, bubble {pp.bubble_fraction:.1%}"
    row = {"mesh": mesh_text, "axes": axes, "inter_host_axes": inter,
           **_plan_row(plan, flops, hardware, cluster.num_devices), "stages": pp.num_stages,
           "note": note, "plan_time_s": round(plan_time_s, 2)}
    out: Ranked = [(row, plan)]
    single = pp.single_stage_time_s
    if pp.num_stages > 1 and single is not None:
        out.append(({"mesh": mesh_text, "axes": "whole cluster, one stage", "status": "single stage",
                     "note": f"{fmt_time(single)}/step" if math.isfinite(single) else _no_single(pp)}, None))
    return out


def _no_single(pp: PipelinePlan) -> str:
    """Why the pipeline search has no single-stage plan, and how far it searched."""
    free = pp.single_stage_time_unconstrained_s
    if pp.planning.single_stage_bound:
        return f"does not fit: {pp.planning.single_stage_bound}"
    if pp.planning.single_stage_mesh_search:
        return "does not fit the budget on any mesh shape searched"
    text = "does not fit the budget as the per-layer tables price it"
    if free is not None and math.isfinite(free):
        text += (f" ({fmt_time(free)}/step ignoring memory, {free / pp.step_time_s:.1f}x this pipeline: "
                 "the whole-program mesh search was skipped)")
    return text


def plan_view(ranked: Ranked, graph: Graph, label: str, devices: int, cluster: Cluster | None,
              hardware: Mapping[str, float], budget: float | None, flops: Mapping[str, float],
              planning_time_s: float) -> PlanView:
    """The best plan of `ranked` with its context block (model, target, shapes, FLOPs, ranking,
    and the logical axis rules read off it) as a `PlanView`; `view.data` is what `--json` saves."""
    best = ranked[0][1]
    data = best.to_dict()
    multi_stage = bool(best.pipeline) and len(best.stages) > 1
    data["context"] = {
        "model": label,
        "devices": devices,
        "cluster": None if cluster is None else {"hosts": cluster.hosts, "devices_per_host": cluster.devices_per_host},
        "cluster_text": cluster.describe() if cluster else f"{devices} devices",
        "inter_host_axes": ([0] if multi_stage and best.mesh.ndim > 1 else
                            list(best.options.inter_host_axes)),
        "hardware": dict(hardware),
        "memory_budget_bytes": budget,
        "input_shapes": [list(graph.tensors[t].shape) for t in graph.inputs],
        "input_dtypes": [str(graph.tensors[t].dtype) for t in graph.inputs],
        "model_flops": dict(flops),
        "params": sum(graph.tensors[t].size for t, p in zip(graph.inputs, graph.input_paths) if "['params']" in p),
        "ranking": [row for row, _ in ranked],
        "planning_time_s": round(planning_time_s, 2),
    }
    if cluster is not None and cluster.topology is not None and best.mesh.size == cluster.num_devices:
        data["context"]["topology"] = {"text": str(cluster),
                                       "split": [list(p) for p in cluster.topology.split_axes(best.mesh.shape)]}
    view = PlanView.from_dict(data)
    if view.rules is not None and not multi_stage:  # a multi-stage plan's top-level specs are placeholders
        data["context"]["logical_axis_rules"] = view.rules.to_dict()
    return view
