"""Predicted per-device memory against XLA's compiled `memory_analysis()`, on the zoo's small models.

For each model and mesh: the plan's predicted peak (`prediction.memory_bytes_per_device`), the
compiled program's peak (arguments + outputs + temporaries - aliased, per device) and their ratio.
Issue 11 asks for predicted memory within 10% of the compiled figure, including a RoPE transformer
(llama) and a conv net with batch norm (wide-resnet).

Run: .venv/bin/python experiments/check_memory.py [--mesh 2x4] [--model NAME ...]
Results: experiments/results/memory.json and memory.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import planner  # noqa: E402
from xla_hooks.inspect import memory_stats  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = ("mlp-tiny", "gpt-tiny", "gpt-small-test", "llama-tiny", "llama-small-test", "bert-tiny", "moe-tiny",
          "wresnet-tiny", "plain-mlp-tiny")


def run(name: str, mesh: str) -> dict:
    b = get_model(name)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile()
    measured = memory_stats(compiled).peak_bytes
    predicted = plan.prediction.memory_bytes_per_device
    return {"model": name, "mesh": mesh, "predicted_bytes": int(predicted), "compiled_bytes": int(measured),
            "ratio": round(predicted / measured, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--model", action="append")
    args = p.parse_args()
    rows = []
    for name in args.model or MODELS:
        try:
            rows.append(run(name, args.mesh))
        except Exception as e:  # a model this check cannot run is a row, not a crash
            rows.append({"model": name, "mesh": args.mesh, "error": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["Predicted vs compiled per-device memory (experiments/check_memory.py)", "",
             "| model | mesh | predicted MiB | compiled MiB | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mesh']} | - | - | {r['error']} |")
        else:
            lines.append(f"| {r['model']} | {r['mesh']} | {r['predicted_bytes'] / 2**20:.2f} | "
                         f"{r['compiled_bytes'] / 2**20:.2f} | {r['ratio']:.2f} |")
    (RESULTS / "memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
