"""Planning time vs depth and vs devices, split into trace / ILP build / solve (and stage DP for
pipelines), planned abstractly (nothing allocated, no devices needed).

Sweeps (defaults; --quick runs the first two points of each):
  depth:    gpt2-small widths and llama-7b widths at 12, 24, 48, 96 layers on an 8x8 mesh description
  devices:  gpt2-small and llama-7b (12 layers) on 2x4, 8x8, 16x16 and 32x32 mesh descriptions (8 .. 1024
            devices)
  pipeline: gpt3-39b (Alpa's shape) on an 8x8:v100 cluster and llama-70b (unrolled, batch 1024) on
            128x8:h100, pipeline auto (trace / layer costs / DP)
  shapes:   gpt3-39b on 8x8:v100, pipeline auto, at batch 1024, 512 and 256 planned one after the other in
            one process sharing a `PlanningMemo` (as `planner plan --batch 1024,512,256` does), then at
            sequence lengths 1024 and 2048 (batch 256; the two lengths share one trace of the model
            built for a symbolic length, as `planner plan --seq 1024,2048` does, and nothing else);
            each row's share of the first row's time (--shapes runs only this sweep)

Writes experiments/results/planning.json, planning.md (the table) and planning.png (time vs layers,
time vs devices). The wall times are of this machine, whatever else it was running: compare rows of
one run, not runs of different days.

Run: .venv/bin/python experiments/bench_planning.py [--quick] [--time-limit 60]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from typing import Any

import planner
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.core.pipeline_records import PipelinePlanning
from planner.cost_model import Cluster
from planner.emit.pipeline.planned import plan_stages
from planner.graph.shape_family import ShapeFamily, length_family
from planner.search.mesh_plan import make_plan
from planner.stages.microbatches import PlanningMemo, microbatch_args
from zoo import get_model

RESULTS = pathlib.Path(__file__).parent / "results"


def single_stage(model: str, layers: int, mesh: tuple[int, int], time_limit: float) -> dict:
    b = get_model(model, layers=layers, dtype="bfloat16")  # as users train: bf16 compute, fp32 state
    t0 = time.perf_counter()
    graph = planner.trace(b.train_step, b.abstract_state(), b.abstract_batch())
    trace_s = time.perf_counter() - t0
    plan = make_plan(graph, MeshSpec(mesh, ("data", "model")), PlanOptions(solver_time_limit=time_limit))
    total = plan.solver.planning_time_s
    solve = plan.solver.solve_time_s
    return {
        "sweep": "", "model": model, "layers": layers, "devices": mesh[0] * mesh[1], "mesh": f"{mesh[0]}x{mesh[1]}",
        "trace_s": round(trace_s, 2), "build_s": round(total - solve, 2), "solve_s": round(solve, 2),
        "stage_dp_s": 0.0, "total_s": round(trace_s + total, 2), "ops": len(graph.ops),
        "det_units": plan.solver.deterministic_time,
        "decisions": plan.solver.decisions, "distinct": plan.solver.variables_shared,
        "status": plan.solver.status, "predicted_step_s": plan.prediction.step_time_s,
    }


def pipeline(model: str, cluster: str, time_limit: float, config: dict | None = None) -> dict:
    b = get_model(model, **(config or {}))
    t0 = time.perf_counter()
    plan = planner.plan(b.train_step, b.abstract_state(), b.abstract_batch(), hardware=cluster,
                        pipeline="auto", solver_time_limit=time_limit)
    total = time.perf_counter() - t0
    info = (plan.pipeline.planning if plan.pipeline is not None else None) or PipelinePlanning()
    hosts, per_host = (int(x) for x in cluster.split(":")[0].split("x"))
    return {
        "sweep": "pipeline", "model": model, "layers": b.config.layers, "devices": hosts * per_host, "mesh": cluster,
        "trace_s": info.trace_s, "build_s": info.layer_costs_s, "solve_s": None,
        "stage_dp_s": info.dp_s, "total_s": round(total, 2), "ops": None, "det_units": None,
        "decisions": info.ilp_solves, "distinct": info.distinct_layers,
        "status": f"{len(plan.stages) or 1} stage(s)", "predicted_step_s": plan.prediction.step_time_s,
    }


def shape_sweep(time_limit: float) -> list[dict]:
    """GPT-39B on Alpa's testbed at several batch sizes sharing one memo, then at two sequence lengths."""
    cluster = Cluster.parse("8x8:v100")
    rows: list[dict] = []
    memos: dict[int, PlanningMemo] = {}
    models: dict[int, Any] = {}  # one model per memo, given each batch size (as `planner plan --batch A,B` does)
    lengths: list[Any] = []  # the family of every sequence length, traced at the first "seq" row
    for label, batch, seq, memo_key in (("batch", 1024, None, 0), ("batch", 512, None, 0), ("batch", 256, None, 0),
                                        ("seq", 256, 1024, 1), ("seq", 256, 2048, 2)):
        # the batch sizes' memo keeps the layer ILPs for the later sizes, as the command's sweep does
        memo = memos.setdefault(memo_key, PlanningMemo(keep_layer_problems=memo_key == 0))
        t0 = time.perf_counter()
        b = models.setdefault(memo_key, get_model("gpt3-39b", batch=batch, dtype="float16",
                                                  **({"seq": seq} if seq else {})))
        print(f"[bench_planning] shapes: batch {batch} seq {b.config.seq} ...", file=sys.stderr, flush=True)
        if label == "seq":  # as `cli.plan._from_seq_family`: one trace of the model built for a symbolic length
            if not lengths:
                family = length_family(lambda s: _step_and_args(get_model("gpt3-39b", batch=batch, dtype="float16",
                                                                          seq=s)))
                if not isinstance(family, ShapeFamily):
                    raise SystemExit(f"bench_planning: gpt3-39b has no family of lengths: {family}")
                lengths.append(family)
            memo.family, memo.step = lengths[0].with_sizes(s=b.config.seq), b.train_step
        args = (b.abstract_state(), microbatch_args((b.abstract_state(), b.abstract_batch()), batch)[1])
        graph = memo.graph_at(b.train_step, batch) or planner.trace(b.train_step, *args)
        trace_s = time.perf_counter() - t0
        plan, pp = plan_stages(b.train_step, args, graph, cluster, PlanOptions(pipeline="auto",
                                                                                solver_time_limit=time_limit), memo=memo)
        total = time.perf_counter() - t0
        info = pp.planning
        rows.append({
            "sweep": f"shapes:{label}", "model": f"gpt3-39b b{batch} s{b.config.seq}", "layers": b.config.layers,
            "devices": 64, "mesh": "8x8:v100", "trace_s": round(trace_s + (info.trace_s or 0), 2),
            "build_s": info.layer_costs_s, "solve_s": None, "stage_dp_s": info.dp_s, "total_s": round(total, 2),
            "ops": len(graph.ops), "det_units": None, "decisions": info.ilp_solves, "distinct": info.distinct_layers,
            "status": f"{pp.num_stages} stage(s), {pp.num_microbatches} microbatches",
            "predicted_step_s": plan.prediction.step_time_s,
            "of_first": round(total / rows[0]["total_s"], 3) if rows else 1.0})
        print(f"[bench_planning]   {total:.1f} s, {pp.step_time_s:.4g} s/step", file=sys.stderr, flush=True)
    return rows


def _step_and_args(b) -> tuple:
    """A zoo bundle's train step and its abstract (state, batch)."""
    return b.train_step, (b.abstract_state(), b.abstract_batch())


def table(rows: list[dict]) -> str:
    cols = ("sweep", "model", "layers", "mesh", "trace_s", "build_s", "solve_s", "det_units", "stage_dp_s", "total_s",
            "decisions", "distinct", "status", "of_first")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({r["model"] for r in rows if r["sweep"] == "depth"}):
        pts = [r for r in rows if r["sweep"] == "depth" and r["model"] == model]
        a.plot([r["layers"] for r in pts], [r["total_s"] for r in pts], "o-", label=f"{model} total")
        a.plot([r["layers"] for r in pts], [r["trace_s"] for r in pts], "x--", label=f"{model} trace")
    a.set_xlabel("layers (8x8 mesh)")
    a.set_ylabel("planning time, s")
    a.legend(fontsize=8)
    for model in sorted({r["model"] for r in rows if r["sweep"] == "devices"}):
        pts = [r for r in rows if r["sweep"] == "devices" and r["model"] == model]
        for key, style in (("total_s", "o-"), ("solve_s", "d--")):
            b.plot([r["devices"] for r in pts], [r[key] for r in pts], style, label=f"{model} {key}")
    b.set_xscale("log", base=2)
    b.set_xlabel("devices (12 layers)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two points per sweep, no pipeline row")
    parser.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT limit per plan, seconds")
    parser.add_argument("--shapes", action="store_true", help="only the batch / sequence-length sweep "
                                                                "(results/planning_shapes.md)")
    args = parser.parse_args()
    if args.shapes:
        rows = shape_sweep(args.time_limit)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "planning_shapes.json").write_text(json.dumps(rows, indent=2) + "\n")
        (RESULTS / "planning_shapes.md").write_text(
            "Planning GPT-39B on 8x8 V100 (pipeline auto) at several shapes in one process (seconds, this machine; "
            f"1-minute load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). Batch rows "
            "share one PlanningMemo; the seq rows share one trace of the model for both lengths (nothing else); "
            "of_first: the row's time over the first row's.\n\n" + table(rows) + "\n")
        print(table(rows))
        return 0
    depths = (12, 24) if args.quick else (12, 24, 48, 96)
    meshes = ((2, 4), (8, 8)) if args.quick else ((2, 4), (8, 8), (16, 16), (32, 32))
    rows = []

    def run(sweep: str, fn, *a) -> None:
        print(f"[bench_planning] {sweep}: {a[:3]} ...", file=sys.stderr, flush=True)
        row = fn(*a)
        row["sweep"] = sweep
        rows.append(row)
        print(f"[bench_planning]   total {row['total_s']} s (trace {row['trace_s']}, build {row['build_s']}, "
              f"solve {row['solve_s']}, dp {row['stage_dp_s']}) {row['status']}", file=sys.stderr, flush=True)

    for model in ("gpt2-small", "llama-7b"):
        for layers in depths:
            run("depth", single_stage, model, layers, (8, 8), args.time_limit)
    for model in ("gpt2-small", "llama-7b"):
        for mesh in meshes:
            run("devices", single_stage, model, 12, mesh, args.time_limit)
    if not args.quick:
        # V100 has no bfloat16: users train GPT-39B there in float16 (fp32 master weights), as `planner plan` does.
        run("pipeline", pipeline, "gpt3-39b", "8x8:v100", args.time_limit, {"dtype": "float16"})
        # Llama-70B on 1024 H100 at batch 1024 (the goal: planned within 300 s), layers unrolled: a stage owns
        # its layers' weights (a scanned model's stacked weights would stay on one stage).
        run("pipeline", pipeline, "llama-70b", "128x8:h100", args.time_limit,
            {"scan_layers": False, "batch": 1024, "dtype": "bfloat16"})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planning.json").write_text(json.dumps(rows, indent=2) + "\n")
    load = os.getloadavg()[0]
    (RESULTS / "planning.md").write_text(
        "Planning time (seconds, this machine; abstract planning). det_units: CP-SAT deterministic time, "
        f"independent of the machine's load (1-minute load average at the end of the run: {load:.1f} on "
        f"{os.cpu_count()} cores).\n\n" + table(rows) + "\n")
    plot(rows, RESULTS / "planning.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
