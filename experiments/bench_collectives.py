"""Predicted vs measured time of every collective, and of a planned train step, on this machine.

Profiles the local devices (default: 8 simulated CPU devices as a 2x4 mesh) the way `planner
profile` does, then measures every collective again at sizes *between* the profiled ones (so the
profiled model is judged on interpolation, not on its own samples) and compares three numbers per
point: the analytic model (hardware preset), the profiled model, and the measurement. Errors are
summarised per size range. Finally it plans a model with each cost model, runs the planned step, and
compares predicted with measured step time.

    python experiments/bench_collectives.py [--max-bytes 16MiB] [--model gpt-tiny] [--hardware cpu]

Writes experiments/results/collectives.json (and the profile it measured beside it).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner  # noqa: E402
from planner.cost_model import COLLECTIVES, CostModel, get_hardware  # noqa: E402
from planner.cost_model import profiling  # noqa: E402
from planner.cost_model.fit import geometric_sizes  # noqa: E402
from planner.cost_model.profile_db import axis_groups, write_json_atomic  # noqa: E402
from planner.core.mesh import parse_mesh  # noqa: E402
from zoo import get_model  # noqa: E402
from planner.core.units import parse_bytes  # noqa: E402

RANGES = (("< 64KiB", 0, 64 * 2**10), ("64KiB-4MiB", 64 * 2**10, 4 * 2**20), (">= 4MiB", 4 * 2**20, float("inf")))
RESULTS = Path(__file__).resolve().parent / "results"


def _rel_err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def bench_collectives(mesh, spec, db, analytic: CostModel, profiled: CostModel, sizes, repeats: int) -> list[dict]:
    rows = []
    bar = profiling.ProgressBar(len(axis_groups(spec)) * len(COLLECTIVES) * len(sizes))
    for axes in axis_groups(spec):
        for kind in COLLECTIVES:
            for size in sizes:
                nbytes, times = profiling.measure_collective(mesh, kind, axes, size, repeats, warmup=2)
                measured = db.net_seconds(float(np.median(times)))
                rows.append({
                    "collective": kind,
                    "axes": "*".join(spec.axis_names[a] for a in axes),
                    "nbytes": nbytes,
                    "measured_s": measured,
                    "analytic_s": analytic.collective_time(kind, nbytes, axes),
                    "profiled_s": profiled.collective_time(kind, nbytes, axes),
                })
                bar.step(f"{kind} {size}")
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for name, lo, hi in RANGES:
        sel = [r for r in rows if lo <= r["nbytes"] < hi]
        if not sel:
            continue
        out.append({
            "range": name,
            "points": len(sel),
            "analytic_median_rel_err": float(np.median([_rel_err(r["analytic_s"], r["measured_s"]) for r in sel])),
            "profiled_median_rel_err": float(np.median([_rel_err(r["profiled_s"], r["measured_s"]) for r in sel])),
            "profiled_p90_rel_err": float(np.percentile([_rel_err(r["profiled_s"], r["measured_s"]) for r in sel], 90)),
        })
    return out


def _time_step(step, state, batch, repeats: int) -> float:
    state_out, metrics = step(state, batch)  # plans and compiles
    jax.block_until_ready((state_out, metrics))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_step(model: str, mesh_text: str, hardware: str, db, repeats: int) -> list[dict]:
    bundle = get_model(model)
    state = bundle.init_state(jax.random.key(0))
    batch = bundle.make_batch(jax.random.key(1))
    rows = []
    for name, options in (("analytic", {"hardware": hardware}), ("profiled", {"profile": db})):
        step = planner.plan_parallel(bundle.train_step, mesh=mesh_text, **options)
        t0 = time.perf_counter()
        plan = step.plan(state, batch)
        planning = time.perf_counter() - t0
        measured = _time_step(step, state, batch, repeats)
        p = plan.prediction
        rows.append({
            "cost_model": name,
            "model": model,
            "mesh": mesh_text,
            "planning_s": planning,
            "predicted_step_s": p.step_time_s,
            "predicted_compute_s": p.compute_time_s,
            "predicted_communication_s": p.communication_time_s,
            "measured_step_s": measured,
            "measured_minus_launch_s": db.net_seconds(measured),
            "input_batch_spec": str(plan.spec_of("[1]['inputs']")) if "[1]['inputs']" in plan.input_paths else "",
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--max-bytes", default="16MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hardware", default="cpu", help="preset of the analytic model (default: cpu)")
    ap.add_argument("--model", default="gpt-tiny", help="model whose planned step is timed ('' to skip)")
    ap.add_argument("--out", default=str(RESULTS / "collectives.json"))
    args = ap.parse_args(argv)
    max_bytes = int(parse_bytes(args.max_bytes, "--max-bytes"))

    spec, _ = parse_mesh(args.mesh, len(jax.devices()))
    mesh = spec.to_jax_mesh()
    profile_sizes = geometric_sizes(1024, max_bytes, 4)
    probe_sizes = tuple(2 * s for s in profile_sizes[:-1])  # halfway (geometrically) between samples
    print(f"profiling {spec} over {len(jax.devices())} {jax.devices()[0].device_kind} devices "
          f"({len(profile_sizes)} sizes, 1KiB..{args.max_bytes})", file=sys.stderr)
    bar = profiling.ProgressBar(profiling.progress_steps(spec, profile_sizes, COLLECTIVES, True))
    db = profiling.profile(mesh, profile_sizes, args.repeats, 2, progress=bar,
                           settings={"max_bytes": max_bytes, "repeats": args.repeats, "source": "bench_collectives"})
    analytic = CostModel.default(spec, get_hardware(args.hardware))
    profiled = CostModel.from_profile(spec, db)
    print(profiling.summary(db))

    print("measuring again at in-between sizes", file=sys.stderr)
    rows = bench_collectives(mesh, spec, db, analytic, profiled, probe_sizes, args.repeats)
    summary = summarise(rows)

    print(f"\n{'collective':<20}{'axes':<6}{'bytes':>10}{'measured us':>13}{'analytic us':>13}{'profiled us':>13}")
    for r in rows:
        print(f"{r['collective']:<20}{r['axes']:<6}{r['nbytes']:>10}{r['measured_s'] * 1e6:>13.1f}"
              f"{r['analytic_s'] * 1e6:>13.1f}{r['profiled_s'] * 1e6:>13.1f}")
    print(f"\nmedian relative error per size range ({args.hardware} preset vs profile):")
    print(f"{'range':<14}{'points':>7}{'analytic':>10}{'profiled':>10}{'profiled p90':>14}")
    for s in summary:
        print(f"{s['range']:<14}{s['points']:>7}{s['analytic_median_rel_err']:>10.0%}"
              f"{s['profiled_median_rel_err']:>10.0%}{s['profiled_p90_rel_err']:>14.0%}")

    steps = []
    if args.model:
        print(f"\nplanning and running {args.model} on {args.mesh}", file=sys.stderr)
        steps = bench_step(args.model, args.mesh, args.hardware, db, args.repeats)
        print(f"\n{'cost model':<11}{'predicted ms':>13}{'(comm ms)':>11}{'measured ms':>13}{'meas-launch ms':>16}"
              f"{'ratio':>7}  batch spec")
        for s in steps:
            print(f"{s['cost_model']:<11}{s['predicted_step_s'] * 1e3:>13.2f}{s['predicted_communication_s'] * 1e3:>11.2f}"
                  f"{s['measured_step_s'] * 1e3:>13.2f}{s['measured_minus_launch_s'] * 1e3:>16.2f}"
                  f"{s['measured_minus_launch_s'] / s['predicted_step_s']:>7.2f}  {s['input_batch_spec']}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    db.save(Path(args.out).with_name("profile_" + Path(args.out).name))
    write_json_atomic(args.out, {
        "device_kind": db.device_kind, "num_devices": db.num_devices, "mesh": str(spec), "jax_version": jax.__version__,
        "created": db.created, "analytic_hardware": args.hardware, "profile_sizes": list(profile_sizes),
        "collectives": rows, "error_by_size_range": summary, "steps": steps,
    })
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
