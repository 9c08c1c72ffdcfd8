"""Gradient accumulation on the zoo's GPT and Llama: k = 1, 2, 4 microbatches
planned on a 2x4 mesh of 8 simulated CPU devices, compiled, run and compared with the unsharded
step at the derived tolerances (tests/helpers.py), with XLA's `memory_analysis()` peak beside the
prediction. Too slow for the suite (tests/test_accumulation.py covers the MLPs).

    .venv/bin/python experiments/check_accumulation.py [--models gpt-tiny,llama-tiny] [--ks 1,2,4]
Writes experiments/results/accumulation.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import planner  # noqa: E402
from tests.helpers import assert_bundle_step_close, concrete  # noqa: E402
from xla_hooks.inspect import memory_stats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-tiny,llama-tiny")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "accumulation.json"))
    a = ap.parse_args()
    rows = []
    for name in a.models.split(","):
        b, state, batch = concrete(name, batch=a.batch)
        ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
        for k in (int(x) for x in a.ks.split(",")):
            t0 = time.perf_counter()
            step = planner.plan_parallel(b.train_step, mesh=a.mesh, accumulate=k)
            plan = step.plan(state, batch)
            planned = time.perf_counter() - t0
            mem = memory_stats(step.lower(state, batch).compile())
            new_state, metrics = step(state, batch)
            try:
                assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
                numerics = "match"
            except AssertionError as e:
                numerics = "MISMATCH: " + str(e).splitlines()[0][:200]
            row = {"model": name, "mesh": a.mesh, "batch": a.batch, "k": k,
                   "predicted_memory_bytes": plan.prediction.memory_bytes_per_device,
                   "measured_peak_bytes": mem.peak_bytes, "measured_temp_bytes": mem.temp_bytes,
                   "predicted_step_time_s": plan.prediction.step_time_s, "numerics": numerics,
                   "plan_time_s": round(planned, 1), "total_time_s": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
