"""Memory levers on models that do not fit (issue 13): Llama-70B- and GPT-39B-shaped steps planned
abstractly on one host of 8 x H100 ("1x8:h100") and on 8 hosts of 8 x V100 ("8x8:v100"), with the
levers the single-stage planner has: sharding alone, then sharding + gradient accumulation
(accumulate="auto"). Prints per row: fits or not, the plan's predicted memory or the smallest peak
found, the predicted step time, the microbatch count and the planning time.

    .venv/bin/python experiments/bench_memory_levers.py [--layers N] [--models llama-70b,gpt3-39b]
        [--clusters 1x8:h100,8x8:v100] [--time-limit S]
Full depth is slow on a 2-core machine (each mesh shape and each microbatch count is one ILP);
--layers N plans N layers at the full widths. Results: experiments/results/memory_levers.json.
Not here yet: recomputation per layer kind and host offload in single-stage plans.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from planner.accumulate import plan_accumulation  # noqa: E402
from planner.cost_model import Cluster  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.graph import trace  # noqa: E402
from planner.mesh import MeshSpec  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.planning import make_plan  # noqa: E402
from planner.search import inter_host_axes  # noqa: E402
from planner.units import format_bytes  # noqa: E402
from zoo import get_model  # noqa: E402


def run(model: str, cluster: str, layers: int | None, accumulate, time_limit: float) -> dict:
    hw = Cluster.parse(cluster)
    over = {"layers": layers} if layers else {}
    b = get_model(model, **over, dtype=hw.hardware.default_dtype)
    mesh = MeshSpec((hw.hosts, hw.devices_per_host), ("x", "y"))
    budget = hw.hardware.memory_bytes
    options = PlanOptions(hardware=cluster, memory_budget=budget, solver_time_limit=time_limit,
                          inter_host_axes=inter_host_axes(mesh.shape, hw.devices_per_host))
    t0 = time.perf_counter()
    row = {"model": model, "layers": layers or b.config.layers, "cluster": cluster, "mesh": str(mesh),
           "levers": "sharding" + (" + accumulation" if accumulate else ""), "budget": format_bytes(budget)}
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    try:
        if accumulate:
            def plan_micro(g, inner):
                return make_plan(g, mesh, dataclasses.replace(options, memory_budget=inner))

            plan = plan_accumulation(b.train_step, graph, accumulate, budget, plan_micro, mesh).plan
        else:
            plan = make_plan(graph, mesh, options)
        p = plan.prediction
        row.update(fits=True, memory=format_bytes(p.memory_bytes_per_device), step_time_s=p.step_time_s,
                   microbatches=plan.solver.get("accumulation", {}).get("microbatches", 1))
    except PlannerError as e:
        row.update(fits=False, memory=format_bytes(e.min_memory_bytes) if getattr(e, "min_memory_bytes", None) else "?",
                   lower_bound=format_bytes(e.lower_bound_bytes) if getattr(e, "lower_bound_bytes", None) else "?",
                   message=str(e))
    row["planning_time_s"] = round(time.perf_counter() - t0, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-70b,gpt3-39b")
    ap.add_argument("--clusters", default="1x8:h100,8x8:v100")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "memory_levers.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for model in a.models.split(","):
        for cluster in a.clusters.split(","):
            for acc in (None, "auto"):
                row = run(model, cluster, a.layers, acc, a.time_limit)
                rows.append(row)
                print(f"{row['model']:<10} L={row['layers']:<3} {row['cluster']:<9} {row['levers']:<24} "
                      f"fits={row['fits']!s:<5} memory={row['memory']:<10} "
                      f"t={row.get('step_time_s', float('nan')):.4g}s k={row.get('microbatches', '-')} "
                      f"planned in {row['planning_time_s']}s", flush=True)
    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
