"""How long `planner plan` takes end to end, as a user runs it (a fresh process per case).

Cases (defaults): gpt2-small on 8 devices (mesh search) and GPT-39B (`gpt3-39b`, Alpa's benchmark
shape) on 64 devices (mesh search; Alpa reported ~40 min for this). Each case runs the console
script in a subprocess, records wall time, the planner's own per-mesh times (from the --json
context) and the best mesh; results go to experiments/results/bench_cli.json and a table is printed.

Run: .venv/bin/python experiments/bench_cli.py [--case gpt2-small:8] [--case gpt3-39b:64] [--time-limit S]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

RESULTS = pathlib.Path(__file__).parent / "results"
DEFAULT_CASES = ("gpt2-small:8", "gpt3-39b:64")


def run_case(model: str, devices: int, extra: list[str]) -> dict:
    exe = pathlib.Path(sys.executable).with_name("planner")
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "plan.json"
        cmd = [str(exe), "plan", "--model", model, "--devices", str(devices), "--json", str(out), *extra]
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CPU seconds are the fairer figure on a shared machine: wall time also counts other jobs.
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        row = {"model": model, "devices": devices, "command": " ".join(cmd[1:]), "exit": proc.returncode,
               "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_avg_1m": round(os.getloadavg()[0], 2)}
        if proc.returncode != 0:
            row["error"] = proc.stderr.strip().splitlines()[-1:]
            return row
        data = json.loads(out.read_text())
    ctx = data["context"]
    row.update(
        best_mesh="x".join(str(v) for v in data["mesh"].values()),
        step_time_s=data["predicted"]["step_time_s"],
        memory_bytes_per_device=data["predicted"]["memory_bytes_per_device"],
        planning_time_s=ctx["planning_time_s"],
        meshes=[{k: r.get(k) for k in ("mesh", "status", "step_time_s", "plan_time_s")} for r in ctx["ranking"]],
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", metavar="MODEL:DEVICES", help="repeatable; default: "
                        + ", ".join(DEFAULT_CASES))
    parser.add_argument("--time-limit", type=float, help="pass --time-limit to planner plan")
    args = parser.parse_args(argv)
    extra = ["--quiet"] + (["--time-limit", str(args.time_limit)] if args.time_limit else [])
    rows = []
    for case in args.case or DEFAULT_CASES:
        model, _, devices = case.partition(":")
        print(f"planning {model} on {devices} devices ...", file=sys.stderr, flush=True)
        rows.append(run_case(model, int(devices), extra))
        r = rows[-1]
        print(f"  {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU" + (f", best mesh {r['best_mesh']}" if "best_mesh" in r else
                                                 f", failed: {r.get('error')}"), file=sys.stderr, flush=True)
    RESULTS.mkdir(exist_ok=True)
    record = {"host_cpus": os.cpu_count(), "python": sys.version.split()[0], "cases": rows}
    (RESULTS / "bench_cli.json").write_text(json.dumps(record, indent=1))
    print(f"{'model':<12} {'devices':>7} {'wall':>8} {'cpu':>8} {'best':>6} {'step time':>10}  per-mesh planning times")
    for r in rows:
        meshes = ", ".join(f"{m['mesh']} {m['plan_time_s']}s" for m in r.get("meshes", []) if m.get("plan_time_s"))
        step = f"{r['step_time_s'] * 1e3:.1f} ms" if "step_time_s" in r else "-"
        print(f"{r['model']:<12} {r['devices']:>7} {r['wall_s']:>7.1f}s {r['cpu_s']:>7.1f}s {r.get('best_mesh', '-'):>6} "
              f"{step:>10}  {meshes}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
