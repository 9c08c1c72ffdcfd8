"""The jobs people run, planned with no lever flags (issue: "one search over every lever, on by
default"): each is the `planner` command a new user types, run as a whole process on this machine,
timed, with what it answered (fits or not, predicted step time and peak, the levers the plan uses).

    .venv/bin/python experiments/bench_default_levers.py [--jobs llama7b-1x8,...] [--profile FILE]

Jobs (published configurations at their shapes; our own model code):
  llama7b-1x8     Llama-2-7B, batch 16, seq 4096, 1x8 H100 (`--model llama-7b`, scanned layers)
  llama3-70b-1x8  Llama-3-70B-shaped, batch 8, seq 4096, 1x8 H100 (experiments/models/llama3_70b.py)
  llama70b-8x8    Llama-2-70B, batch 128, seq 4096, 8x8 H100 (`--model llama-70b`)
  gpt2-cpu        gpt2-small on 8 CPU devices with the profile `planner profile --mesh 2x4` measures
                  here (run first unless --profile names one; its time is reported on its own)
  compare-7b      `planner compare` of the Llama-2-7B step on mesh 8 against fsdp and dp
  gpt39b-8x8      GPT-3 39B (Alpa's benchmark model), batch 1024 (Alpa's), 8x8 V100 16 GB: a multi-host
                  job where pipeline stages are weighed by default (no goal of the issue's: recorded)

Goals (the issue's): each plans within 120 s (llama70b-8x8: 300 s) and fits its device memory.
`--out` names another result file for a subset of jobs (the default file keeps the issue's jobs).
Results: experiments/results/default_levers.json and .md (overwritten; the date is in them).
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
PLANNER = str(pathlib.Path(sys.executable).with_name("planner"))

JOBS = {
    "llama7b-1x8": (["plan", "--model", "llama-7b", "--cluster", "1x8:h100-sxm", "--batch", "16", "--seq", "4096"], 120),
    "llama3-70b-1x8": (["plan", "--fn", "experiments/models/llama3_70b.py:make_step", "--cluster", "1x8:h100-sxm",
                        "--batch", "8", "--seq", "4096"], 120),
    "llama70b-8x8": (["plan", "--model", "llama-70b", "--cluster", "8x8:h100-sxm", "--batch", "128",
                      "--seq", "4096"], 300),
    "gpt2-cpu": (["plan", "--model", "gpt2-small", "--devices", "8", "--profile", "{profile}"], 120),
    "compare-7b": (["compare", "--model", "llama-7b", "--mesh", "8", "--hardware", "h100-sxm", "--batch", "16",
                    "--seq", "4096", "--baselines", "fsdp,dp"], 120),
    "gpt39b-8x8": (["plan", "--model", "gpt3-39b", "--cluster", "8x8:v100", "--batch", "1024"], None),
}


def _run(argv: list[str]) -> tuple[int, float, str, str]:
    t0 = time.perf_counter()
    p = subprocess.run([PLANNER, *argv], cwd=ROOT, capture_output=True, text=True)
    return p.returncode, time.perf_counter() - t0, p.stdout, p.stderr


def _levers(plan: dict) -> list[str]:
    out = []
    levers = plan.get("levers") or {}
    remat, offload, acc = levers.get("remat"), levers.get("offload"), levers.get("accumulation")
    if remat and remat.get("policy") != "off":
        out.append(f"remat {remat['policy']}" + (f" ({remat['scans']} scanned stack)" if remat.get("scans") else
                                                 f" ({len(remat.get('layers') or ())} layers)"))
    if offload and offload.get("inputs"):
        out.append(f"offload {len(offload['inputs'])} of {offload['candidates']} leaves")
    if acc and acc.get("microbatches", 1) > 1:
        out.append(f"accumulation x{acc['microbatches']}")
    if len(plan.get("stages") or ()) > 1:
        out.append(f"pipeline {len(plan['stages'])} stages x {plan['pipeline']['num_microbatches']} microbatches")
    if (plan.get("options") or {}).get("donate_argnums"):
        out.append("donated state")
    return out


def run_job(name: str, profile: str | None) -> dict:
    argv, goal = JOBS[name]
    argv = [a.replace("{profile}", profile or "") for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "plan.json")
        if argv[0] == "plan":
            argv = argv + ["--json", out_json]
        code, seconds, stdout, stderr = _run(argv)
        plan = json.load(open(out_json)) if os.path.exists(out_json) else None
    row = {"job": name, "command": "planner " + " ".join(argv[:-2] if argv[0] == "plan" else argv),
           "exit": code, "seconds": round(seconds, 1), "goal_s": goal,
           "within_goal": None if goal is None else seconds <= goal}
    if plan is not None:
        pred = plan["predicted"]
        budget = plan["context"].get("memory_budget_bytes")
        row.update(step_time_s=pred["step_time_s"], memory_gb=round(pred["memory_bytes_per_device"] / 1e9, 2),
                   budget_gb=round(budget / 1e9, 2) if budget else None, mesh="x".join(str(v) for v in plan["mesh"].values()),
                   levers=_levers(plan),
                   fits=budget is None or pred["memory_bytes_per_device"] <= budget)
    else:
        lines = [ln for ln in stdout.splitlines() if ln.strip()]
        row.update(fits=code == 0, answer=(stderr.strip().splitlines() or [""])[-1][:400] if code else None,
                   output_head=lines[:8] if code == 0 else None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default=",".join(j for j, (_, goal) in JOBS.items() if goal is not None))
    ap.add_argument("--profile", default=None, help="a CPU profile of this machine (default: measure one first)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "default_levers"))
    a = ap.parse_args()
    jobs = a.jobs.split(",")
    rows, profile, profile_s = [], a.profile, None
    with tempfile.TemporaryDirectory() as tmp:
        if "gpt2-cpu" in jobs and profile is None:
            profile = os.path.join(tmp, "cpu_profile.json")
            code, profile_s, _, err = _run(["profile", "--out", profile, "--mesh", "2x4", "--quiet"])
            if code:
                sys.exit(f"planner profile failed: {err.strip().splitlines()[-1:]}")
            print(f"planner profile --mesh 2x4: {profile_s:.1f} s", flush=True)
        for name in jobs:
            row = run_job(name, profile)
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {"date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()} CPU cores",
              "profile_s": None if profile_s is None else round(profile_s, 1), "rows": rows}
    pathlib.Path(a.out + ".json").write_text(json.dumps(record, indent=1))
    lines = [f"# Default levers on the jobs people run ({record['date']}, {record['machine']})", "",
             "| job | exit | planned in (s) | goal (s) | fits | step time (s) | peak / budget (GB) | levers | mesh |",
             "|---|---:|---:|---:|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['job']} | {r['exit']} | {r['seconds']} | {r['goal_s'] or '-'} | {r.get('fits')} | "
                     f"{r.get('step_time_s', '-') if r.get('step_time_s') is None else round(r['step_time_s'], 3)} | "
                     f"{r.get('memory_gb', '-')} / {r.get('budget_gb', '-')} | {', '.join(r.get('levers') or []) or '-'} "
                     f"| {r.get('mesh', '-')} |")
    lines += ["", "Commands:", ""] + [f"- {r['job']}: `{r['command']}`" for r in rows]
    if record["profile_s"] is not None:
        lines.append(f"- the CPU profile: `planner profile --mesh 2x4 --out FILE` ({record['profile_s']} s)")
    pathlib.Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
