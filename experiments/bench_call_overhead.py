"""The host time a planned step adds per call, as ratios against `jax.jit` of the same step.

A planned step (`plan_parallel(...)(state, batch)`) runs the program the planner emitted; on one
device that program is the unsharded step's, so its time per step should equal `jax.jit`'s. Any
difference is host work per call (placing arguments, handing results back). Measured here, each
configuration beside its baseline in the same run, state donated as a training loop does:
  - one device: `jax.jit(step)` vs the step planned on mesh "1";
  - 2x4 devices: the step planned on the string mesh "2x4" vs the same step planned on
    `jax.make_mesh((2, 4), ...)` (Explicit axes: results come back on the user's mesh).
Medians of `--repeats` steps after `--warmup`; several rounds alternate the pair, so drift in the
machine's load falls on both.

Usage: .venv/bin/python experiments/bench_call_overhead.py [--models gpt-small-test,gpt-tiny]
Results: experiments/results/call_overhead.{json,md}. On a GPU the same comparison for one device
is a column of experiments/check_offload.py (H200: results/offload_check.md).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import planner  # noqa: E402
from check_gpu import _time_steps  # noqa: E402 (experiments/, beside this file)
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def measure(name: str, rounds: int, warmup: int, repeats: int) -> list[dict]:
    b = get_model(name, dtype="bfloat16")
    batch = b.make_batch(jax.random.key(1))
    one = jax.devices()[:1]
    pairs = {
        "one device": (("jax.jit", jax.jit(b.train_step, donate_argnums=(0,))),
                       ("planned, mesh '1'", planner.plan_parallel(b.train_step, mesh="1", devices=one,
                                                                   donate_argnums=(0,)))),
        "2x4": (("planned, mesh '2x4'", planner.plan_parallel(b.train_step, mesh="2x4", donate_argnums=(0,))),
                ("planned, jax.make_mesh (Explicit)",
                 planner.plan_parallel(b.train_step, mesh=jax.make_mesh((2, 4), ("x", "y")), donate_argnums=(0,)))),
    }
    rows = []
    for where, ((base_name, base), (other_name, other)) in pairs.items():
        times: dict[str, list[float]] = {base_name: [], other_name: []}
        for _ in range(rounds):
            for label, step in ((base_name, base), (other_name, other)):  # a fresh state: it is donated
                times[label].append(statistics.median(_time_steps(step, b.init_state(jax.random.key(0)), batch,
                                                                  warmup, repeats)))
        base_s, other_s = statistics.median(times[base_name]), statistics.median(times[other_name])
        rows.append({"model": name, "devices": where, "baseline": base_name, "baseline_s": base_s,
                     "config": other_name, "config_s": other_s, "ratio": other_s / base_s,
                     "leaves": len(jax.tree.leaves(b.abstract_state())), "rounds": rounds, "repeats": repeats})
        print(f"{name:<16} {where:<10} {base_name:<22} {base_s * 1e3:8.2f} ms   {other_name:<34} "
              f"{other_s * 1e3:8.2f} ms   ratio {other_s / base_s:.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-small-test,gpt-tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    rows = [r for m in args.models.split(",") for r in measure(m, args.rounds, args.warmup, args.repeats)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "call_overhead.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Host time a planned step adds per call (experiments/bench_call_overhead.py)", "",
             f"{jax.devices()[0].device_kind} devices, jax {jax.__version__}; medians of {args.repeats} steps x "
             f"{args.rounds} alternating rounds; bf16 compute, state donated.", "",
             "| model | devices | state leaves | baseline | ms/step | configuration | ms/step | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['devices']} | {r['leaves']} | {r['baseline']} | {r['baseline_s'] * 1e3:.2f} | "
              f"{r['config']} | {r['config_s'] * 1e3:.2f} | {r['ratio']:.3f} |" for r in rows]
    (out / "call_overhead.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
