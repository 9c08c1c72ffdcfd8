"""Every named baseline (planner/configs/baselines.py) run on CPU devices against the unsharded step.

For each (model, mesh, baseline): the baseline's pins are evaluated (`planner.planning.evaluate`'s code path:
every argument pinned, intermediates planned), lowered, compiled, run once, and the first step is
compared with the unsharded jit step by tests/helpers.py's derived tolerances
(`assert_bundle_step_close`). Too slow for the test suite (each row compiles and runs a step); results go to
experiments/results/baselines_numerics.json.

With `--pipeline-stages N` every baseline runs as NAME+ppN instead (N even stages of the mesh's
devices, `num_microbatches` 2, run from its saved JSON by `planner.emit.pipeline.planned.run_plan`) and
is compared with `assert_first_step_close`; results go to baselines_pp_numerics.json.

Run: python experiments/check_baselines.py [--models gpt-tiny,llama-tiny] [--meshes 2x4] [--pipeline-stages 2]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import planner  # noqa: E402
from planner.configs.baselines import NAMES, baseline_pins  # noqa: E402
from planner.emit.pipeline.planned import run_plan  # noqa: E402
from tests.helpers import assert_bundle_step_close, assert_first_step_close, concrete  # noqa: E402
from zoo import make_optimizer  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-tiny,llama-tiny")
    ap.add_argument("--meshes", default="2x4")
    ap.add_argument("--baselines", default=",".join(NAMES))
    ap.add_argument("--pipeline-stages", type=int, default=None, help="run NAME+ppN pipeline baselines")
    ap.add_argument("--out", default=None, help="default: results/baselines_numerics.json "
                    "(baselines_pp_numerics.json with --pipeline-stages)")
    args = ap.parse_args(argv)
    args.out = args.out or str(RESULTS / ("baselines_pp_numerics.json" if args.pipeline_stages else
                                          "baselines_numerics.json"))
    rows = []
    for model in args.models.split(","):
        b, state, batch = concrete(model)
        ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
        for mesh in args.meshes.split(","):
            for name in args.baselines.split(","):
                t = time.perf_counter()
                row = {"model": model, "mesh": mesh, "baseline": name}
                try:
                    if args.pipeline_stages:
                        row["baseline"] = f"{name}+pp{args.pipeline_stages}"
                        plan = planner.evaluate(b.train_step, state, batch, mesh=mesh, baseline=row["baseline"],
                                                hardware="cpu", num_microbatches=2)
                        new_state, metrics = run_plan(b.train_step, planner.Plan.from_json(plan.to_json()))(
                            state, batch)
                        opt = make_optimizer(b.config.learning_rate, b.config.weight_decay)
                        assert_first_step_close(b.loss_fn, opt, state, batch, new_state, metrics, ref_state,
                                                ref_metrics, train_step=b.train_step)
                        row["predicted_step_time_s"] = plan.prediction.step_time_s
                    else:
                        step = planner.plan_parallel(b.train_step, mesh=mesh, pins=baseline_pins(name),
                                                     unpinned="replicate")
                        new_state, metrics = step(state, batch)
                        assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
                        row["predicted_step_time_s"] = step.plan(state, batch).prediction.step_time_s
                    row["result"] = "equal to unsharded"
                except Exception as e:  # reported per row, the run goes on
                    row["result"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    traceback.print_exc()
                row["seconds"] = round(time.perf_counter() - t, 1)
                rows.append(row)
                print(f"{model:<12}{mesh:<6}{name:<16}{row['result']}  ({row['seconds']} s)", flush=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"rows": rows, "jax": jax.__version__,
                                                  "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0 if all(r["result"] == "equal to unsharded" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
