"""Communication precision (`--comm-precision`, `planner.ilp.wire`): what each wire format buys on a
bandwidth-bound cluster, and what it costs in numerics.

    .venv/bin/python experiments/bench_comm_precision.py [--parts predict,train] [--steps 50]

- predict: `planner plan` as a user runs it, one whole process per precision (exact, bf16, int8), on
  Alpa's testbed (GPT-39B, 8x8 V100 at 25 Gbit/s between hosts, the pipeline search; batch 1024 and
  the zoo's 8), the comparison suite's GPT-39B row (8x8 A100, batch 64, one stage) and Llama-2-70B
  over two TPU v5p slices (batch 8 and 256): predicted step time, exposed communication, compute,
  bytes moved per device, and the wire records (float32 partial sums, int8 weight gathers, int8
  gradient reductions) of the plan.
- train: gpt-tiny in bf16 (float32 master weights, AdamW) on 8 CPU devices, FSDP-pinned (so weights
  are gathered), planned with the mesh axis priced as a 1 Gbit/s network (where int8 pays at
  gpt-tiny's sizes), trained `--steps` steps from the same initial state on the same batches under each
  precision; the final loss of each against "exact" (goal: int8 within 1%), and after the first
  step the largest parameter difference per leaf group against the exact program.

Results: experiments/results/comm_precision.json and .md (overwritten; the date is in them).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the `planner` command of this checkout (python -m, so a copy of the tree runs its own code)
PLANNER = [sys.executable, "-m", "planner.cli"]
PRECISIONS = ("exact", "bf16", "int8")
JOBS = {
    # Alpa's testbed and configuration (8 hosts of 8 V100 16 GB, 25 Gbit/s between hosts; batch 1024), the
    # planner's default search over pipelines
    "gpt3-39b 8x8 V100 25Gbit pipeline-auto b1024": ["--model", "gpt3-39b", "--cluster", "8x8:v100", "--inter-host",
                                                        "25Gbit", "--batch", "1024", "--pipeline", "auto"],
    # the same testbed at the zoo's batch (8), as `planner plan` runs it without a batch flag
    "gpt3-39b 8x8 V100 25Gbit pipeline-auto b8": ["--model", "gpt3-39b", "--cluster", "8x8:v100", "--inter-host",
                                                     "25Gbit", "--pipeline", "auto"],
    # the comparison suite's row (experiments/results/suite.md: 8x8 A100 80 GB, batch 64, one stage)
    "gpt3-39b 8x8 A100 1-stage b64": ["--model", "gpt3-39b", "--cluster", "8x8:a100-80gb", "--batch", "64",
                                        "--pipeline", "off"],
    # Llama-2-70B over two TPU v5p slices of 128 chips (4x4x8 tori, the data-center network between them),
    # at the zoo's batch (8 sequences of 4096; batch 256, one sequence per chip, plans for over 10 minutes per
    # precision on the 2-core machine, memory-bound: not run)
    "llama-70b 2xv5p:4x4x8 b8": ["--model", "llama-70b", "--cluster", "2xv5p:4x4x8", "--pipeline", "off"],
}


def _wire(plan: dict) -> dict:
    records = list(plan.get("wire", ()))
    for st in plan.get("stages", ()):
        records += list((st.get("plan") or {}).get("wire", ()))
    return {"partial_sums_f32": sum(w["kind"] == "partial-sum" for w in records),
            "int8_gathers": sum(w["kind"] == "gather" for w in records),
            "int8_reductions": sum(w["kind"] == "reduce" for w in records)}


def predict(jobs: list[str]) -> list[dict]:
    rows = []
    for job in jobs:
        for precision in PRECISIONS:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "plan.json")
                t0 = time.perf_counter()
                p = subprocess.run([*PLANNER, "plan", *JOBS[job], "--comm-precision", precision, "--json", out,
                                    "--quiet"], cwd=ROOT, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if p.returncode != 0:
                    rows.append({"job": job, "precision": precision, "error": (p.stderr or p.stdout).strip()[-300:]})
                    continue
                plan = json.loads(pathlib.Path(out).read_text())
            pr = plan["predicted"]
            rows.append({"job": job, "precision": precision, "step_time_s": pr["step_time_s"],
                         "exposed_comm_s": pr["communication_time_s"], "compute_s": pr["compute_time_s"],
                         "bytes_moved": pr["bytes_moved_per_device"],
                         "stages": max(1, len(plan.get("stages", ()))), "plan_s": round(wall, 1), **_wire(plan)})
            print(rows[-1], flush=True)
    return rows


def train(steps: int) -> dict:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np

    import planner
    from planner.configs.baselines import baseline_pins
    from planner.core.mesh import MeshSpec
    from planner.graph.trace import trace
    from zoo import get_model

    b = get_model("gpt-tiny", dtype="bfloat16")
    state = b.init_state(jax.random.key(0))
    # four batches in turn: a loss the model can bring down (fresh random tokens each step would leave
    # it at log(vocab), where every run agrees)
    batches = [b.make_batch(jax.random.key(100 + i % 4)) for i in range(steps)]
    graph = trace(b.train_step, state, batches[0])
    mesh = MeshSpec((8,), ("x",))
    shapes = [graph.tensors[t].shape for t in graph.inputs]
    pins = baseline_pins("fsdp")(graph.input_paths, shapes, mesh)
    losses: dict[str, list[float]] = {}
    first: dict[str, object] = {}
    wire: dict[str, dict] = {}
    for precision in PRECISIONS:
        # the mesh axis priced as a slow network (1 Gbit/s between "hosts"): at gpt-tiny's sizes the
        # int8 formats pay only where bytes are dear, as they do for a large model at 25 Gbit/s
        f = planner.plan_parallel(b.train_step, mesh="8", pins=pins, comm_precision=precision, hardware="v100",
                                  inter_host_axes=(0,), inter_host="1Gbit")
        s = state
        losses[precision] = []
        for i, batch in enumerate(batches):
            s, metrics = f(s, batch)
            losses[precision].append(float(metrics["loss"] if isinstance(metrics, dict) else metrics))
            if i == 0:
                first[precision] = jax.tree.map(np.asarray, s)
        plan = f.plan(state, batches[0])
        wire[precision] = {"partial_sums_f32": sum(w.kind == "partial-sum" for w in plan.wire),
                           "int8_gathers": sum(w.kind == "gather" for w in plan.wire),
                           "int8_reductions": sum(w.kind == "reduce" for w in plan.wire)}
        print(precision, "final loss", losses[precision][-1], wire[precision], flush=True)
    groups = {}
    for precision in ("bf16", "int8"):
        worst: dict[str, float] = {}
        flat = jax.tree_util.tree_flatten_with_path(first[precision])[0]
        for (path, a), e in zip(flat, jax.tree.leaves(first["exact"])):
            name = jax.tree_util.keystr(path)
            if "params" in name and a.size:
                key = name.split("['params']")[-1].split("]")[0].strip("['")
                worst[key] = max(worst.get(key, 0.0), float(np.max(np.abs(a.astype(np.float64) - e))))
        groups[precision] = worst
    final = {p: losses[p][-1] for p in PRECISIONS}
    return {"steps": steps, "first_loss": losses["exact"][0], "final_loss": final,
            "relative_to_exact": {p: abs(final[p] - final["exact"]) / abs(final["exact"]) for p in PRECISIONS},
            "losses": losses, "wire": wire, "first_step_param_diff_vs_exact": groups}


def _g(x) -> str:
    return "" if x is None else f"{x:.4g}"


def write(result: dict) -> None:
    out = ROOT / "experiments" / "results"
    (out / "comm_precision.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Communication precision ({result['date']})", "",
             "`.venv/bin/python experiments/bench_comm_precision.py` on this 2-core CPU machine "
             "(abstract planning; the training part on 8 simulated CPU devices).", ""]
    if result.get("predict"):
        lines += ["## Predicted step time per wire format (whole `planner plan` processes)", "",
                  "`step / compute`: the step time over its compute time (critical path, pipeline bubbles "
                  "included): the most that removing every exposed collective of that plan could buy; a wire "
                  "format changes only the bytes on the wire (and adds quantisation), so against the exact "
                  "plan it bounds what any format can buy with that plan's structure.", "",
                  "| job | precision | step s | vs exact | exposed comm s | compute s | step / compute | "
                  "bytes moved / device | stages | f32 partial sums | int8 gathers | int8 reductions | planning s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        exact = {r["job"]: r.get("step_time_s") for r in result["predict"] if r["precision"] == "exact"}
        for r in result["predict"]:
            if "error" in r:
                lines.append(f"| {r['job']} | {r['precision']} | error: {r['error']} | | | | | | | | | | |")
                continue
            ratio = exact[r["job"]] / r["step_time_s"] if exact.get(r["job"]) else float("nan")
            lines.append(f"| {r['job']} | {r['precision']} | {r['step_time_s']:.4g} | {ratio:.3f}x | "
                         f"{r['exposed_comm_s']:.4g} | {_g(r.get('compute_s'))} | "
                         f"{_g(r['step_time_s'] / r['compute_s'] if r.get('compute_s') else None)} | "
                         f"{r['bytes_moved'] / 1e9:.2f} GB | {r['stages']} | "
                         f"{r['partial_sums_f32']} | {r['int8_gathers']} | {r['int8_reductions']} | {r['plan_s']} |")
        lines.append("")
    if result.get("train"):
        t = result["train"]
        lines += [f"## Training gpt-tiny (bf16, FSDP pins, 8 CPU devices, the axis priced at 1 Gbit/s) for "
                  f"{t['steps']} steps", "",
                  f"Four batches in turn; the exact run's loss goes from {t['first_loss']:.4f} to "
                  f"{t['final_loss']['exact']:.4f}.", "",
                  "| precision | final loss | vs exact | f32 partial sums | int8 gathers | int8 reductions |",
                  "|---|---|---|---|---|---|"]
        for p in PRECISIONS:
            lines.append(f"| {p} | {t['final_loss'][p]:.5f} | {100 * t['relative_to_exact'][p]:.3f}% | "
                         f"{t['wire'][p]['partial_sums_f32']} | {t['wire'][p]['int8_gathers']} | "
                         f"{t['wire'][p]['int8_reductions']} |")
        lines += ["", "Largest parameter difference after the first step, against the exact program:", ""]
        for p, worst in t["first_step_param_diff_vs_exact"].items():
            lines.append(f"- {p}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())))
        lines.append("")
    (out / "comm_precision.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="predict,train")
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    parts = args.parts.split(",")
    path = ROOT / "experiments" / "results" / "comm_precision.json"
    result = json.loads(path.read_text()) if path.exists() else {}  # the parts not run are kept
    result["date"] = datetime.date.today().isoformat()
    if "train" in parts:
        result["train"] = train(args.steps)
    if "predict" in parts:  # rows of other jobs kept; this run's jobs replaced
        jobs = args.jobs.split(",")
        result["predict"] = [r for r in result.get("predict", []) if r["job"] not in jobs] + predict(jobs)
    write(result)


if __name__ == "__main__":
    main()
