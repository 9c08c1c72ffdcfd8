"""Memory levers on models that do not fit: Llama-70B- and GPT-39B-shaped steps planned
abstractly on one host of 8 x H100 ("1x8:h100") and on 8 hosts of 8 x V100 ("8x8:v100"), with the
levers the single-stage planner has, one at a time and together (row "joint": the default
composition, `planner.planning.composition.compose`): sharding alone, then sharding + gradient accumulation
(accumulate="auto"), and sharding + the model's own per-layer recomputation (where the model has the
option, as the zoo's scanned Llama: `remat=True`, nn.remat inside the scanned layer; the planner's
graph-level remat does not reach into a scan; otherwise the planner's remat="auto", `planner.levers.remat`) + host offload of the optimizer state (offload="auto": only the leaves the budget needs,
`planner.ilp.offload`). The train state is donated in every row (`donate_argnums=0`). Prints per row: fits or not, the plan's predicted memory or the smallest peak
found, the predicted step time, the microbatch count and the planning time.

    .venv/bin/python experiments/bench_memory_levers.py [--layers N] [--models llama-70b,gpt3-39b]
        [--clusters 1x8:h100,8x8:v100] [--time-limit S]
Full depth is slow on a 2-core machine (each mesh shape and each microbatch count is one ILP);
--layers N plans N layers at the full widths. Results: experiments/results/memory_levers.json.
Not here: offload of master parameters or activations (not planned yet).
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

from planner.levers.accumulate import micro_options, plan_accumulation  # noqa: E402
from planner.cost_model import Cluster  # noqa: E402
from planner.core.errors import PlannerError  # noqa: E402
from planner.graph.trace import trace  # noqa: E402
from planner.core.mesh import MeshSpec  # noqa: E402
from planner.ilp.offload import streamed  # noqa: E402
from planner.core.options import PlanOptions  # noqa: E402
from planner.search.mesh_plan import make_plan  # noqa: E402
from planner.search.candidates import inter_host_axes  # noqa: E402
from planner.core.units import format_bytes  # noqa: E402
from planner.levers.remat import plan_remat  # noqa: E402
from planner.planning.composition import compose  # noqa: E402
from planner.search.results import MeshResult  # noqa: E402
from zoo import get_model  # noqa: E402
from planner.core.units import parse_bytes  # noqa: E402
from zoo.registry import get_config  # noqa: E402


LEVER_SETS = ("sharding", "accumulation", "remat+offload", "joint")


def run(model: str, cluster: str, layers: int | None, levers: str, time_limit: float,
        overrides: dict | None = None, budget: float | None = None, offload: str = "auto") -> dict:
    hw = Cluster.parse(cluster)
    accumulate = "auto" if levers == "accumulation" else 1
    over = {"layers": layers} if layers else {}
    over.update(overrides or {})
    own_remat = levers in ("remat+offload", "joint") and "remat" in {f.name for f in dataclasses.fields(get_config(model))}
    if own_remat:
        over["remat"] = True
    b = get_model(model, **over, dtype=hw.hardware.default_dtype)
    mesh = MeshSpec((hw.hosts, hw.devices_per_host), ("x", "y"))
    budget = budget or hw.hardware.memory_bytes
    options = PlanOptions(hardware=cluster, memory_budget=budget, solver_time_limit=time_limit,
                          inter_host_axes=inter_host_axes(mesh.shape, hw.devices_per_host),
                          offload=offload if levers == "remat+offload" else None if levers == "joint" else "off",
                          remat="auto" if levers in ("remat+offload", "joint") else "off",
                          accumulate=None if levers == "joint" else accumulate,
                          donate_argnums=(0,))  # the train state, as every training loop donates it
    t0 = time.perf_counter()
    row = {"model": model, "layers": layers or b.config.layers, "cluster": cluster, "mesh": str(mesh),
           "overrides": overrides or {},
           "levers": {"sharding": "sharding", "accumulation": "sharding + accumulation",
                      "remat+offload": f"sharding + remat + offload {offload}",
                      "joint": "every lever (the default: planning.composition)"}[levers],
           "budget": format_bytes(budget)}
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    if options.offload not in (None, "off"):  # a streamed optimizer update, as `planner plan --offload` plans it
        graph = streamed(graph)
    try:
        if levers == "joint":
            plan = compose(b.train_step, graph, options,
                           lambda g, o, smallest, only=None, **_: (MeshResult(mesh, make_plan(g, mesh, o, min_peak_search=smallest),
                                                              None, o.inter_host_axes, 0.0),), mesh).plan
            row["remat"] = plan.levers.remat.policy if plan.levers.remat else "off"
        elif accumulate == "auto":
            def plan_micro(g, inner):
                return g, make_plan(g, mesh, micro_options(options, inner))

            plan = plan_accumulation(b.train_step, graph, accumulate, budget, plan_micro, mesh).plan
        elif levers == "remat+offload" and not own_remat:  # unrolled layers: the planner's own recomputation
            _, plan, policy, _ = plan_remat(graph, "auto", budget,
                                         lambda g, search: make_plan(streamed(g), mesh, options,
                                                                     min_peak_search=search),
                                         lambda p: p)
            row["remat"] = policy
        else:
            plan = make_plan(graph, mesh, options)
        p = plan.prediction
        off, acc = plan.levers.offload, plan.levers.accumulation
        row.update(fits=True, memory=format_bytes(p.memory_bytes_per_device), step_time_s=p.step_time_s,
                   microbatches=acc.microbatches if acc is not None else 1,
                   offloaded=f"{len(off.inputs)} of {off.candidates} optimizer-state leaves "
                             f"({off.params} master parameters), "
                             f"{format_bytes(off.host_bytes_per_device)}/device" if off is not None else "none")
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
    ap.add_argument("--levers", default=",".join(LEVER_SETS), help=f"comma-separated from {LEVER_SETS}")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary override (Llama 3: 128256)")
    ap.add_argument("--unrolled", action="store_true",
                    help="layers as a Python loop (scan_layers=False), not one scan over stacked leaves")
    ap.add_argument("--offload", default="auto", choices=("auto", "opt-state", "opt-state+params"),
                    help="the offload mode of the remat+offload levers (default auto)")
    ap.add_argument("--budget", default=None, help="memory budget per device (default: the device's memory), "
                    "e.g. 48GB")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "memory_levers.json"))
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for model in a.models.split(","):
        for cluster in a.clusters.split(","):
            for levers in a.levers.split(","):
                over = {**({"vocab": a.vocab} if a.vocab else {}), **({"scan_layers": False} if a.unrolled else {})}
                row = run(model, cluster, a.layers, levers, a.time_limit, over or None,
                          parse_bytes(a.budget, "--budget") if a.budget else None, a.offload)
                rows.append(row)
                print(f"{row['model']:<10} L={row['layers']:<3} {row['cluster']:<9} {row['levers']:<38} "
                      f"fits={row['fits']!s:<5} memory={row['memory']:<10} "
                      f"t={row.get('step_time_s', float('nan')):.4g}s k={row.get('microbatches', '-')} "
                      f"planned in {row['planning_time_s']}s", flush=True)
    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
