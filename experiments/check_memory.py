"""Predicted per-device memory against XLA's compiled `memory_analysis()`, on the zoo's small models.

For each model and mesh: the plan's predicted peak (`prediction.memory_bytes_per_device`), the
compiled program's peak (arguments + outputs + temporaries - aliased, per device) and their ratio.
The goal: predicted memory within 10% of the compiled figure, including a RoPE transformer
(llama) and a conv net with batch norm (wide-resnet). Besides the data-parallel plans the planner
makes without a budget, sharded plans forced by a budget: 0.6x the per-device peak of hand-written
data parallelism on 1x8 (`--budget-model`, gpt-tiny by default), where the compiled peak is also
compared with the budget.

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
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import planner  # noqa: E402
from xla_hooks.inspect import memory_stats  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = ("mlp-tiny", "gpt-tiny", "gpt-small-test", "llama-tiny", "llama-small-test", "bert-tiny", "moe-tiny",
          "wresnet-tiny", "plain-mlp-tiny")


NOTES = "## Notes"  # memory.md's heading of the analysis kept across runs
BUDGET_FRACTION = 0.6  # of hand-written data parallelism's peak: below it the planner must shard


def _data_parallel_peak(b, state, batch) -> int:
    """Per-device peak of hand-written data parallelism on 8 devices: state replicated, batch split."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), state)
    split = jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P("d")), batch)
    return memory_stats(jax.jit(b.train_step, in_shardings=(rep, split)).lower(state, batch).compile()).peak_bytes


def run(name: str, mesh: str, budget_fraction: float | None = None) -> dict:
    b = get_model(name)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    budget = None if budget_fraction is None else int(budget_fraction * _data_parallel_peak(b, state, batch))
    step = planner.plan_parallel(b.train_step, mesh=mesh, memory_budget=budget)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile()
    measured = memory_stats(compiled).peak_bytes
    predicted = plan.prediction.memory_bytes_per_device
    return {"model": name, "mesh": mesh, "budget_bytes": budget, "predicted_bytes": int(predicted),
            "compiled_bytes": int(measured), "ratio": round(predicted / measured, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--model", action="append")
    p.add_argument("--budget-model", action="append", help="models planned on 1x8 under a budget (default gpt-tiny)")
    args = p.parse_args()
    rows = []
    runs = [(name, args.mesh, None) for name in args.model or MODELS]
    runs += [(name, "1x8", BUDGET_FRACTION) for name in args.budget_model or ("gpt-tiny",)]
    for name, mesh, fraction in runs:
        try:
            rows.append(run(name, mesh, fraction))
        except Exception as e:  # a model this check cannot run is a row, not a crash
            rows.append({"model": name, "mesh": mesh, "error": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["Predicted vs compiled per-device memory (experiments/check_memory.py), XLA:CPU, 8 host devices", "",
             "| model | mesh | budget MiB | predicted MiB | compiled MiB | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mesh']} | - | - | - | {r['error']} |")
        else:
            budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.2f}"
            lines.append(f"| {r['model']} | {r['mesh']} | {budget} | {r['predicted_bytes'] / 2**20:.2f} | "
                         f"{r['compiled_bytes'] / 2**20:.2f} | {r['ratio']:.3f} |")
    # The analysis below the table (written by hand, from the buffer assignments) is kept across runs.
    path = RESULTS / "memory.md"
    notes = path.read_text().partition(NOTES)[2] if path.exists() else ""
    path.write_text("\n".join(lines) + "\n" + (f"\n{NOTES}{notes}" if notes else ""))


if __name__ == "__main__":
    main()
