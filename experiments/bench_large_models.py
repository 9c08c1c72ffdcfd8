"""Full-depth large models planned abstractly on an 8x8 mesh description (the suite plans 2- and
4-layer versions at the same widths; layer sharing makes the ILP independent of depth).

For each model: trace time, planning time, ops, decisions, distinct decisions, solver status,
predicted step time and per-device memory. Results: experiments/results/large_models.json.

Run: .venv/bin/python experiments/bench_large_models.py [--model gpt3-39b] [--model llama-70b]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import planner
from planner.core.mesh import MeshSpec
from zoo import get_model
from planner.core.options import PlanOptions
from planner.search.mesh_plan import make_plan

RESULTS = pathlib.Path(__file__).parent / "results"


def run(name: str, time_limit: float) -> dict:
    b = get_model(name)
    t0 = time.perf_counter()
    graph = planner.trace(b.train_step, b.abstract_state(), b.abstract_batch())
    t1 = time.perf_counter()
    plan = make_plan(graph, MeshSpec((8, 8), ("data", "model")), PlanOptions(solver_time_limit=time_limit))
    t2 = time.perf_counter()
    return {
        "model": name, "mesh": "8x8", "trace_s": round(t1 - t0, 2), "plan_s": round(t2 - t1, 2),
        "ops": len(graph.ops), "decisions": plan.solver.decisions,
        "distinct_decisions": plan.solver.variables_shared, "status": plan.solver.status,
        "predicted_step_s": plan.prediction.step_time_s,
        "memory_gb_per_device": plan.prediction.memory_bytes_per_device / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="zoo model (repeatable); default gpt3-39b and llama-70b")
    parser.add_argument("--time-limit", type=float, default=120.0, help="CP-SAT limit per plan, seconds")
    args = parser.parse_args()
    rows = [run(name, args.time_limit) for name in (args.model or ["gpt3-39b", "llama-70b"])]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "large_models.json").write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(f"{r['model']:<10} {r['mesh']}  trace {r['trace_s']:6.1f} s  plan {r['plan_s']:6.1f} s  "
              f"{r['ops']} ops, {r['decisions']} decisions, {r['distinct_decisions']} distinct, {r['status']}")


if __name__ == "__main__":
    main()
