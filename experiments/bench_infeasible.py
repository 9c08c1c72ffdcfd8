"""How long the single-stage mesh search takes to answer, as a user runs it.

Cases (defaults): GPT-39B (`gpt3-39b`, Alpa's shape) single stage on 8 hosts x 8 V100 16 GB at
25 Gbit/s between hosts (`--pipeline off`: a fitting plan or a one-line "does not fit" within 60 s
is the goal), the same with a 10 GB budget (below every mesh's lower bound: the "does not fit"
path), and gpt2-small on 8 devices (goal <= 10 s). Each case runs the console script in a
fresh subprocess and records wall and CPU seconds (CPU is the fairer figure: two cores are shared
with other jobs), the 1-minute load average before and after, the exit status, the answer (the best
mesh and its step time, or the one-line error), and per mesh what the search did with it (from the
log: not solved by its memory bound, pruned by its step-time bound, solved with its CP-SAT
deterministic time). `--pythonpath DIR` runs another checkout of the planner (e.g. `git archive`
of an older commit) in the same environment, for a before/after pair; `--label` names the row.

`--bounds` computes instead, in this process, each GPT-39B mesh's bounds as the search sees them
(ILP build time, `memory_bounds.memory_lower_bound`, `build.step_time_lower_bound`, the fewest-bytes
plan's peak) into infeasible_bounds.json: why a mesh is or is not skipped.

Results: experiments/results/infeasible.json (rows appended per label and case) and infeasible.md.

Run: .venv/bin/python experiments/bench_infeasible.py [--case 39b|39b-10gb|gpt2] [--label after]
     [--pythonpath /tmp/old-checkout] [--bounds]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results"
CASES = {
    "39b": ["--model", "gpt3-39b", "--cluster", "8x8:v100", "--inter-host", "25Gbit", "--pipeline", "off"],
    "gpt2": ["--model", "gpt2-small", "--devices", "8"],
    # the same single-stage search under a budget below every mesh's lower bound: "does not fit"
    "39b-10gb": ["--model", "gpt3-39b", "--cluster", "8x8:v100", "--inter-host", "25Gbit", "--pipeline", "off",
                 "--memory-budget", "10GB"],
}
_MESH_LINE = re.compile(r"\] mesh (\S+): (.*)$")
_UNITS = re.compile(r"\(([0-9.e+-]+|\?|None) deterministic units")


def _mesh_records(log: str) -> dict[str, dict]:
    """Per mesh, the search's last word on it from the log (and the deterministic time it names)."""
    out: dict[str, dict] = {}
    for line in log.splitlines():
        m = _MESH_LINE.search(line)
        if not m:
            continue
        mesh, what = m.groups()
        rec = out.setdefault(mesh, {"mesh": mesh})
        rec["outcome"] = what.strip()
        units = _UNITS.search(what)
        if units and units.group(1) not in ("?", "None"):
            rec["deterministic_time"] = float(units.group(1))
    return out


def run_case(name: str, label: str, pythonpath: str | None) -> dict:
    cmd = [sys.executable, "-m", "planner.cli", "plan", *CASES[name]]
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=pythonpath or pathlib.Path(__file__).parent.parent)
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    row = {"label": label, "case": name, "command": "planner plan " + " ".join(CASES[name]),
           "exit": proc.returncode, "wall_s": round(wall, 1), "load_1m_before": round(load_before, 2),
           "load_1m_after": round(load_after, 2), "cores": len(os.sched_getaffinity(0))}
    meshes = _mesh_records(stderr)
    row["meshes"] = list(meshes.values())
    row["deterministic_time_total"] = round(sum(m.get("deterministic_time", 0.0) for m in meshes.values()), 2)
    if proc.returncode == 0:
        best = next((line for line in stdout.splitlines() if re.match(r"\s+1\s", line)), "")
        row["answer"] = " ".join(best.split())
    else:
        row["answer"] = (stderr.strip().splitlines() or [""])[-1]
    return row


def _cpu_seconds(fn, *args):
    """(fn's result, CPU seconds its child processes used)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = fn(*args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return result, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bounds() -> list[dict]:
    """Per mesh of the GPT-39B case: what the search knows before solving (the CLI's options)."""
    import dataclasses

    from planner.cost_model import get_hardware
    from planner.graph.trace import trace
    from planner.ilp.greedy import _min_bytes_choice
    from planner.ilp.liveness import memory_profile
    from planner.ilp.memory_bounds import memory_lower_bound
    from planner.core.options import PlanOptions
    from planner.search.mesh_plan import plan_problem
    from planner.cli.workloads import load_model
    from planner.search.build import step_time_lower_bound
    from planner.search.candidates import candidate_meshes, inter_host_axes

    hw = get_hardware("v100")
    _, step, example = load_model("gpt3-39b", None, None, None, hw.default_dtype)
    graph = trace(step, *example)
    options = PlanOptions.from_kwargs({"memory_budget": float(hw.memory_bytes), "hardware": "8x8:v100",
                                       "inter_host": "25Gbit", "pipeline": False})
    out = []
    for mesh in candidate_meshes(64):
        t0 = time.perf_counter()
        inter = inter_host_axes(mesh.shape, 8)
        problem = plan_problem(graph, mesh, dataclasses.replace(options, inter_host_axes=inter))
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        memory = int(memory_lower_bound(problem).max())
        step_bound = step_time_lower_bound(problem)
        bounded = time.perf_counter() - t0
        fewest = int(memory_profile(problem, _min_bytes_choice(problem)).max())
        out.append({"mesh": str(mesh), "build_s": round(built, 2), "bounds_s": round(bounded, 2),
                    "memory_lower_bound_bytes": memory, "budget_bytes": hw.memory_bytes,
                    "step_time_lower_bound_s": step_bound, "fewest_bytes_plan_peak_bytes": fewest})
        print(json.dumps(out[-1]), flush=True)
    return out


def render(rows: list[dict]) -> str:
    lines = ["# Single-stage mesh search: time to an answer", "",
             "Each row: one fresh `planner plan` process on this machine (2 cores shared with other jobs; "
             "the load average is the 1-minute figure before / after). CP-SAT deterministic units are about "
             "one second of one idle core each (planner/ilp/solver.py), so they compare runs across loads.", "",
             "| label | case | exit | wall s | CPU s | load | det. units | answer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        units = (r["deterministic_time_total"] if any("deterministic_time" in m for m in r["meshes"])
                 else "not logged")
        lines.append(f"| {r['label']} | {r['case']} | {r['exit']} | {r['wall_s']} | {r['cpu_s']} | "
                     f"{r['load_1m_before']} / {r['load_1m_after']} | {units} | "
                     f"{r['answer'][:300]} |")
    lines += ["", "Per mesh (the search's last log line on it):", ""]
    for r in rows:
        lines.append(f"- {r['label']} {r['case']}: " + "; ".join(
            f"{m['mesh']}: {m.get('outcome', '')[:160]}" for m in r["meshes"]))
    path = RESULTS / "infeasible_bounds.json"
    if path.exists():
        lines += ["", "GPT-39B, what the search knows before solving each mesh (`--bounds`):", "",
                  "| mesh | ILP build s | bounds s | memory lower bound | budget | fewest-bytes plan peak | "
                  "step-time lower bound |", "|---|---|---|---|---|---|---|"]
        for b in json.loads(path.read_text()):
            lines.append(f"| {b['mesh']} | {b['build_s']} | {b['bounds_s']} | "
                         f"{b['memory_lower_bound_bytes'] / 1e9:.3f} GB | "
                         f"{b['budget_bytes'] / 1e9:.3f} GB | {b['fewest_bytes_plan_peak_bytes'] / 1e9:.2f} GB | "
                         f"{b['step_time_lower_bound_s']:.4g} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="cases to run (default: all)")
    ap.add_argument("--label", default="current", help="name of this checkout's rows (default: current)")
    ap.add_argument("--pythonpath", default=None, help="run the planner from this directory instead")
    ap.add_argument("--bounds", action="store_true", help="the GPT-39B meshes' bounds, in this process")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "infeasible.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    if args.bounds:
        (RESULTS / "infeasible_bounds.json").write_text(json.dumps(bounds(), indent=1) + "\n")
        (RESULTS / "infeasible.md").write_text(render(rows))
        return
    for name in args.case or ["39b", "39b-10gb", "gpt2"]:
        row, cpu = _cpu_seconds(run_case, name, args.label, args.pythonpath)
        row["cpu_s"] = round(cpu, 1)
        print(json.dumps(row), flush=True)
        rows = [r for r in rows if (r["label"], r["case"]) != (args.label, name)] + [row]
        path.write_text(json.dumps(rows, indent=1) + "\n")
        (RESULTS / "infeasible.md").write_text(render(rows))


if __name__ == "__main__":
    main()
