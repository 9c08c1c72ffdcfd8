"""The planner's GPT plan against hand-written baselines, all measured from XLA's compiled output.

Baselines (on a 2x4 mesh, axes x, y):
  dp        : state replicated, batch split over all 8 devices.
  fsdp      : ZeRO-3: every parameter and optimizer-state tensor split over all 8 devices on its
              largest divisible dim, batch split over all 8 devices; XLA inserts the gathers.
  dp_tp     : batch over x, Megatron tensor parallelism over y (attention heads, MLP hidden,
              vocabulary of the LM head), optimizer state sharded like its parameter.
  planner   : this project's plan.

For each: bytes moved per device (ring formulas over the compiled HLO's collectives), per-device
peak memory (`memory_analysis`), compile time, and for the planner the planning time. Results go
to experiments/results/gpt_baselines.json; the table is printed.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench_gpt_baselines.py
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import planner  # noqa: E402
from zoo import get_model  # noqa: E402
from xla_hooks.inspect import report  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def _mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _largest_split(shape, n):
    for d in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[d] % n == 0:
            spec = [None] * len(shape)
            spec[d] = ("x", "y")
            return P(*spec)
    return P()


def _megatron(path: str, shape) -> P:
    """Megatron-LM layout on axis y for the zoo GPT's parameter names."""
    nd = len(shape)
    if "attn" in path and ("query" in path or "key" in path or "value" in path):
        return P(None, "y", None) if nd == 3 and "kernel" in path else P("y", None) if nd == 2 else P()
    if "attn" in path and "out" in path and "kernel" in path:
        return P("y", None, None)
    if "fc_in" in path:
        return P(None, "y") if nd == 2 else P("y")
    if "fc_out" in path and "kernel" in path:
        return P("y", None)
    if "lm_head" in path:
        return P(None, "y")
    return P()


def _baseline(kind: str, state, batch, mesh):
    def per_leaf(fn, tree):
        return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, fn(jax.tree_util.keystr(p), x.shape)),
                                                tree)

    if kind == "dp":
        s = per_leaf(lambda p, shp: P(), state)
        b = per_leaf(lambda p, shp: P(("x", "y")), batch)
    elif kind == "fsdp":
        s = per_leaf(lambda p, shp: _largest_split(shp, 8), state)
        b = per_leaf(lambda p, shp: P(("x", "y")), batch)
    elif kind == "dp_tp":
        s = per_leaf(_megatron, state)
        b = per_leaf(lambda p, shp: P("x"), batch)
    else:
        raise ValueError(kind)
    return s, b


def measure(compiled) -> dict:
    r = report(compiled)
    return {
        "bytes_moved_per_device": r.bytes_moved_per_device(),
        "collectives": r.counts(),
        "peak_memory_bytes": r.memory.peak_bytes,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS / "gpt_baselines.json"))
    args = ap.parse_args(argv)

    b = get_model(args.model, layers=args.layers, batch=args.batch, seq=args.seq)
    state, batch = b.abstract_state(), b.abstract_batch()
    mesh = _mesh()
    rows = {}
    for kind in ("dp", "fsdp", "dp_tp"):
        s, bs = _baseline(kind, state, batch, mesh)
        t = time.perf_counter()
        compiled = jax.jit(b.train_step, in_shardings=(s, bs), out_shardings=(s, None)).lower(state, batch).compile()
        rows[kind] = {**measure(compiled), "compile_s": time.perf_counter() - t}
        print(f"[{kind}] compiled", file=sys.stderr)

    t = time.perf_counter()
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    plan = step.plan(state, batch)
    plan_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    rows["planner"] = {**measure(compiled), "compile_s": time.perf_counter() - t, "planning_s": plan_s,
                       "predicted_bytes_moved_per_device": plan.prediction.bytes_moved_per_device,
                       "predicted_memory_bytes": plan.prediction.memory_bytes_per_device,
                       "predicted_step_time_s": plan.prediction.step_time_s}

    # Planning time of the full-size model (abstract: nothing is allocated or compiled).
    full = get_model(args.model)
    t = time.perf_counter()
    full_plan = planner.plan(full.train_step, full.abstract_state(), full.abstract_batch(), mesh=mesh)
    full_s = time.perf_counter() - t
    print(f"[planner] full {args.model} planned in {full_s:.1f} s ({full_plan.solver.status})", file=sys.stderr)

    dominated_by = [k for k in ("dp", "fsdp", "dp_tp")
                    if rows[k]["peak_memory_bytes"] <= rows["planner"]["peak_memory_bytes"]
                    and rows[k]["bytes_moved_per_device"] <= rows["planner"]["bytes_moved_per_device"]
                    and (rows[k]["peak_memory_bytes"], rows[k]["bytes_moved_per_device"])
                    != (rows["planner"]["peak_memory_bytes"], rows["planner"]["bytes_moved_per_device"])]
    ref_bytes = max(rows["dp"]["bytes_moved_per_device"], 1.0)
    ref_mem = rows["dp"]["peak_memory_bytes"]
    print(f"\nGPT {args.model} layers={args.layers} batch={args.batch} seq={args.seq} on 2x4 (CPU, compiled HLO)")
    print(f"{'plan':<10}{'MiB moved/dev':>15}{'vs dp':>8}{'peak MiB/dev':>15}{'vs dp':>8}{'compile s':>11}")
    for k, r in rows.items():
        print(f"{k:<10}{r['bytes_moved_per_device'] / 2**20:>15.2f}{r['bytes_moved_per_device'] / ref_bytes:>8.2f}"
              f"{r['peak_memory_bytes'] / 2**20:>15.2f}{r['peak_memory_bytes'] / ref_mem:>8.2f}{r['compile_s']:>11.1f}")
    print(f"planning time: {plan_s:.1f} s; on the (memory, bytes) Pareto front of the baselines: "
          f"{'yes' if not dominated_by else 'no, dominated by ' + ', '.join(dominated_by)}")
    solver = {k: v for k, v in full_plan.solver.to_json().items() if k != "step_parts"}  # facts, not the per-op split
    print(f"full-size {args.model} (all layers, abstract) planning time: {full_s:.1f} s, solver {solver}")
    out = {"config": vars(args), "rows": rows, "planner_dominated_by": dominated_by,
           "full_model_planning_s": full_s, "full_model_solver": solver,
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
