"""The comparison suite (issue 12, part 4): the planner's plan beside every named baseline.

Per (model, cluster, configuration), where a configuration is the planner's plan or one baseline of
planner/baselines.py: predicted step time (and vs the plan), exposed communication, memory per
device, bytes moved per device, whether it fits the device memory budget, planning time split, ILP
size, and, on the compiled rows, bytes moved and peak memory read back from the compiled HLO
(xla_hooks.inspect.report) after the program ran one step on the 8 CPU devices.

Two kinds of rows (the "mode" column says which):
  compiled  small models (`*-tiny`) on the 8 local CPU devices (1x8, 2x4): the plan from
            `planner.PlannedFunction(step, mesh=...)`, a baseline's from the same class with
            `pins=baseline_pins(name), unpinned="replicate"` (what `planner.evaluate` runs); each is
            lowered, compiled, read back and run once (loss finite).
  abstract  zoo models at published sizes, cost model only, nothing compiled: the step is traced
            once per (model, cluster) and `make_plan` runs per configuration with the baseline's
            pins resolved as `evaluate` resolves them (every argument pinned, unmatched leaves
            replicated). 1x8 / 2x4 are one 8-GPU host; 8x8 / 128x8 are clusters of hosts x devices
            ("8x8:a100-80gb": the host axis inter-host).

Cost model: the a100-80gb preset (planner/cost_model/hardware.py), budget = its 80 GB per device;
the planner's plan is planned under that budget, the baselines are costed as they are (fits=no when
they exceed it). Models in bf16 (`dtype="bfloat16"`: bf16 compute, fp32 master weights and
optimizer state). Batch: the zoo's (8) on 1x8 / 2x4; on clusters the zoo's batch is smaller than
the device count, so the global batch is overridden to one sequence (image) per device: 64 on 8x8,
1024 on 128x8 (Alpa's GPT benchmark also uses a global batch of 1024).

Planning time columns: `trace_s` (tracing the step, shared by the configurations of one (model,
cluster) on abstract rows; included in `plan_s` on compiled rows), `build_s` (ILP build and
predictions, the part of `make_plan`'s `planning_time_s` outside the solver's `solve_time_s`),
`solve_s` (the solver's `solve_time_s`), `plan_s` (wall time of that configuration), `other_s`
(`plan_s` minus `planning_time_s`: the step-time split `step_parts` and decision records made after
the plan's clock stops, plus on compiled rows the trace). `stage_dp_s` is empty: the suite plans
single-stage (intra-op) configurations only; the pipeline baselines (`NAME+ppN`) are not in it
yet. ILP size: `decisions` (nodes after follower merging) and `distinct` (after layer sharing).

Output: experiments/results/suite.csv, suite.md (table + goals summary), suite_memory_<model>.png
(memory vs predicted time, every configuration marked, one panel per cluster) and
suite_planning_time.png. The files are rewritten after every (model, cluster), so a run cut short
leaves what it finished.

Run:  python experiments/bench_suite.py                  (`make bench`: the default subset)
      python experiments/bench_suite.py --set full       (`make bench-full`: the rest)
      python experiments/bench_suite.py --set all --models gpt3-1.3b --clusters 8x8
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import pathlib
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import planner  # noqa: E402
from planner.baselines import NAMES, baseline_pins  # noqa: E402
from planner.cost_model import get_hardware  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.graph import trace  # noqa: E402
from planner.mesh import MeshSpec  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.pins import resolve as resolve_pins  # noqa: E402
from planner.planning import check_options, make_plan  # noqa: E402
from xla_hooks.inspect import report  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
PRESET = "a100-80gb"
BUDGET = get_hardware(PRESET).memory_bytes  # 80 GB, the preset's datasheet capacity
# cluster label -> (mesh shape, hardware description, global batch override or None for the zoo's)
CLUSTERS = {
    "1x8": ((1, 8), PRESET, None),
    "2x4": ((2, 4), PRESET, None),
    "8x8": ((8, 8), f"8x8:{PRESET}", 64),
    "128x8": ((128, 8), f"128x8:{PRESET}", 1024),
}
COMPILED_MODELS = ("gpt-tiny", "llama-tiny", "moe-tiny", "bert-tiny", "wresnet-tiny")
LARGE_MODELS = ("gpt2-medium", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-39b", "llama-7b", "llama-70b",
                "gshard-moe-1.3b", "wresnet-50-2", "bert-large")
# The default subset (`make bench`): 736 s measured on the 2-core machine under a load of ~3 (2026-11-23;
# compiled tiny rows 60-180 s each, gpt2-medium 2x4 187 s, gpt3-1.3b 8x8 148 s).
DEFAULT = [("gpt-tiny", "1x8"), ("gpt-tiny", "2x4"), ("llama-tiny", "1x8"), ("llama-tiny", "2x4"),
           ("gpt2-medium", "2x4"), ("gpt3-1.3b", "8x8")]
FULL = ([(m, c) for m in COMPILED_MODELS for c in ("1x8", "2x4")]
        + [(m, c) for m in LARGE_MODELS for c in CLUSTERS
           if not (m in ("gpt3-39b", "llama-70b") and c in ("1x8", "2x4"))])  # 39B/70B need a cluster
FULL = [case for case in FULL if case not in DEFAULT]

FIELDS = ("model", "cluster", "mode", "batch", "config", "step_time_s", "vs_plan", "exposed_comm_s", "memory_bytes",
          "bytes_moved", "fits", "plan_s", "trace_s", "build_s", "solve_s", "other_s", "stage_dp_s", "decisions",
          "distinct", "ops", "solver", "compiled_bytes_moved", "compiled_peak_bytes", "ran", "note")


def _timing(plan, wall: float, trace_s: float | None) -> dict:
    s = plan.solver
    planning, solve = s.get("planning_time_s"), s.get("solve_time_s")
    return {"plan_s": f"{wall:.2f}", "trace_s": "" if trace_s is None else f"{trace_s:.2f}",
            "build_s": "" if planning is None or solve is None else f"{planning - solve:.2f}",
            "solve_s": "" if solve is None else f"{solve:.2f}",
            "other_s": "" if planning is None else f"{wall - planning:.2f}", "stage_dp_s": "",
            "decisions": s.get("decisions", ""), "distinct": s.get("variables_shared", ""), "ops": s.get("ops", ""),
            "solver": s.get("status", "")}


def _prediction(plan) -> dict:
    pr = plan.prediction
    return {"step_time_s": pr.step_time_s, "exposed_comm_s": f"{pr.communication_time_s:.4g}",
            "memory_bytes": int(pr.memory_bytes_per_device), "bytes_moved": int(pr.bytes_moved_per_device),
            "fits": "yes" if pr.memory_bytes_per_device <= BUDGET else "no",
            "note": plan.solver.get("approximation", "")}


def run_compiled(model: str, cluster: str, time_limit: float) -> list[dict]:
    shape, hardware, batch = CLUSTERS[cluster]
    b = get_model(model, dtype="bfloat16", **({"batch": batch} if batch else {}))
    args = (b.abstract_state(), b.abstract_batch())
    key = jax.random.key(0)
    concrete = (b.init_state(key), b.make_batch(key))
    mesh = MeshSpec(shape, ("x", "y"))
    rows = []
    for config in ("planner", *NAMES):
        kw = ({"memory_budget": BUDGET} if config == "planner"
              else {"pins": baseline_pins(config), "unpinned": "replicate"})
        row = {"model": model, "cluster": cluster, "mode": "compiled", "batch": b.config.batch, "config": config}
        t = time.perf_counter()
        try:
            pf = planner.PlannedFunction(b.train_step, mesh=mesh, hardware=hardware, solver_time_limit=time_limit, **kw)
            plan = pf.plan(*args)
        except PlannerError as e:
            rows.append({**row, "note": f"not planned: {str(e).splitlines()[0]}"})
            continue
        row |= _prediction(plan) | _timing(plan, time.perf_counter() - t, None)
        compiled = pf.lower(*args).compile()  # run below as compiled (calling `pf` would compile again)
        r = report(compiled)
        row["compiled_bytes_moved"] = int(r.bytes_moved_per_device())
        row["compiled_peak_bytes"] = r.memory.peak_bytes if r.memory is not None else ""
        _, metrics = compiled(*jax.device_put(concrete, plan.in_shardings))
        loss = float(jax.device_get(metrics["loss"]))
        row["ran"] = f"loss {loss:.4g}" if math.isfinite(loss) else f"NON-FINITE loss {loss}"
        rows.append(row)
    return rows


def run_abstract(model: str, cluster: str, time_limit: float) -> list[dict]:
    shape, hardware, batch = CLUSTERS[cluster]
    b = get_model(model, dtype="bfloat16", **({"batch": batch} if batch else {}))
    t = time.perf_counter()
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    trace_s = time.perf_counter() - t
    mesh = MeshSpec(shape, ("x", "y"))
    shapes = [graph.tensors[i].shape for i in graph.inputs]
    rows = []
    for config in ("planner", *NAMES):
        row = {"model": model, "cluster": cluster, "mode": "abstract", "batch": b.config.batch, "config": config}
        t = time.perf_counter()
        try:
            if config == "planner":
                opts, pins = PlanOptions(hardware=hardware, memory_budget=BUDGET, solver_time_limit=time_limit), None
            else:  # as `planner.evaluate` pins a baseline: every argument, unmatched leaves replicated
                opts = PlanOptions(hardware=hardware, solver_time_limit=time_limit)
                pins = resolve_pins(baseline_pins(config)(graph.input_paths, shapes, mesh), graph.input_paths,
                                    shapes, mesh, complete=True)
            plan = make_plan(graph, mesh, check_options(opts), pins=pins)
        except PlannerError as e:
            rows.append({**row, "note": f"not planned: {str(e).splitlines()[0]}"})
            continue
        rows.append(row | _prediction(plan) | _timing(plan, time.perf_counter() - t, trace_s))
    return rows


def _f(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def summarize(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """The goals' summary lines and one record per (model, cluster)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["cluster"]), []).append(r)
    recs = []
    for (model, cluster), rs in groups.items():
        plan = next((r for r in rs if r["config"] == "planner"), None)
        pt = _f(plan.get("step_time_s")) if plan else None
        fitting = [r for r in rs if r["config"] != "planner" and r.get("fits") == "yes"]
        best = min(fitting, key=lambda r: float(r["step_time_s"]), default=None)
        rec = {"model": model, "cluster": cluster, "mode": rs[0]["mode"], "plan_s": pt,
               "best": best["config"] if best else None, "best_s": _f(best["step_time_s"]) if best else None}
        rec["no_slower"] = pt is not None and (best is None or pt <= rec["best_s"] * (1 + 1e-9))
        rec["speedup"] = rec["best_s"] / pt if pt and rec["best_s"] else None
        rec["faster10"] = rec["speedup"] is not None and rec["speedup"] >= 1.1
        dominated = []
        if plan and plan.get("compiled_peak_bytes") not in (None, ""):
            pb, pm = _f(plan["compiled_bytes_moved"]), _f(plan["compiled_peak_bytes"])
            for r in rs:
                if r["config"] != "planner" and r.get("compiled_peak_bytes") not in (None, ""):
                    rb, rm = _f(r["compiled_bytes_moved"]), _f(r["compiled_peak_bytes"])
                    if rb <= pb and rm <= pm and (rb < pb or rm < pm):
                        dominated.append(r["config"])
        rec["dominated_by"] = dominated if rs[0]["mode"] == "compiled" else None
        recs.append(rec)
    n = len(recs)
    comp = [r for r in recs if r["dominated_by"] is not None]
    lines = [
        f"- (model, cluster) groups: {n} ({len(comp)} compiled, {n - len(comp)} abstract).",
        f"- Plan predicted no slower than the best baseline that fits {BUDGET / 1e9:.0f} GB: "
        f"{sum(r['no_slower'] for r in recs)} of {n}.",
        f"- Plan predicted >= 10% faster than the best fitting baseline: {sum(r['faster10'] for r in recs)} of {n} "
        f"(goal: at least half).",
        f"- Groups where no baseline fits the budget (counted as no slower, not as >= 10% faster): "
        f"{sum(r['best'] is None and r['plan_s'] is not None for r in recs)}; groups with no plan that fits: "
        f"{sum(r['plan_s'] is None for r in recs)}.",
        f"- Compiled groups where the plan is not dominated on (compiled bytes moved, compiled peak memory): "
        f"{sum(not r['dominated_by'] for r in comp)} of {len(comp)}.",
        "", "| model | cluster | mode | plan step s | best fitting baseline | its step s | baseline / plan | "
            "no slower | >= 10% faster | dominated (compiled) by |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        lines.append(" | ".join([
            f"| {r['model']}", r["cluster"], r["mode"], f"{r['plan_s']:.4g}" if r["plan_s"] else "no plan",
            r["best"] or "none fits", f"{r['best_s']:.4g}" if r["best_s"] else "",
            f"{r['speedup']:.3f}" if r["speedup"] else "", "yes" if r["no_slower"] else "NO",
            "yes" if r["faster10"] else "no",
            "n/a (abstract)" if r["dominated_by"] is None else (", ".join(r["dominated_by"]) or "none")]) + " |")
    return lines, recs


def plots(rows: list[dict]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    models = dict.fromkeys(r["model"] for r in rows)
    markers = dict(zip(("planner", *NAMES), "*osD^v<>"))
    for model in models:
        rs = [r for r in rows if r["model"] == model and _f(r.get("step_time_s")) is not None]
        clusters = list(dict.fromkeys(r["cluster"] for r in rs))
        if not clusters:
            continue
        fig, axes = plt.subplots(1, len(clusters), figsize=(4.5 * len(clusters), 4), squeeze=False)
        for ax, cluster in zip(axes[0], clusters):
            here = [r for r in rs if r["cluster"] == cluster]
            for i, r in enumerate(here):  # the plan drawn last, hollow: a baseline it equals shows through
                plan = r["config"] == "planner"
                ax.scatter(float(r["step_time_s"]) * 1e3, float(r["memory_bytes"]) / 2**30, marker=markers[r["config"]],
                           s=260 if plan else 50, label=r["config"], zorder=5 if plan else 3,
                           facecolors="none" if plan else f"C{i}", edgecolors="crimson" if plan else "black",
                           linewidths=1.5 if plan else 0.5)
            if max(float(r["memory_bytes"]) for r in here) > 0.2 * BUDGET:
                ax.axhline(BUDGET / 2**30, color="grey", ls="--", lw=0.8, label=f"{BUDGET / 1e9:.0f} GB budget")
            ax.set_title(f"{model} {cluster} ({here[0]['mode']})", fontsize=9)
            ax.set_xlabel("predicted step time (ms)")
            ax.set_ylabel("memory / device (GiB)")
            ax.set_xscale("log")
            ax.set_yscale("log")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = RESULTS / f"suite_memory_{model}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path.name)
    pts = [r for r in rows if _f(r.get("plan_s")) is not None and _f(r.get("ops")) is not None]
    if pts:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, cluster in enumerate(CLUSTERS):
            for mode, marker in (("compiled", "o"), ("abstract", "s")):
                sel = [r for r in pts if r["mode"] == mode and r["cluster"] == cluster]
                if sel:
                    ax.scatter([float(r["ops"]) for r in sel], [float(r["plan_s"]) for r in sel], color=f"C{i}",
                               marker=marker, label=f"{cluster} {mode}", s=18, alpha=0.7)
        plan_pts = [r for r in pts if r["config"] == "planner"]
        for r in plan_pts:
            ax.annotate(f"{r['model']} {r['cluster']}", (float(r["ops"]), float(r["plan_s"])), fontsize=6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("traced ops")
        ax.set_ylabel("planning time per configuration (s)")
        ax.set_title("plan_s per configuration (abstract rows: without the shared trace)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(RESULTS / "suite_planning_time.png", dpi=90)
        plt.close(fig)
        written.append("suite_planning_time.png")
    return written


def write(rows: list[dict], header: str) -> None:
    for g in {(r["model"], r["cluster"]) for r in rows}:  # vs_plan within each (model, cluster)
        rs = [r for r in rows if (r["model"], r["cluster"]) == g]
        p = next((_f(r.get("step_time_s")) for r in rs if r["config"] == "planner"), None)
        for r in rs:
            parts = [_f(r.get(k)) for k in ("plan_s", "build_s", "solve_s")]
            if not r.get("other_s") and None not in parts and r["mode"] == "abstract":
                r["other_s"] = f"{parts[0] - parts[1] - parts[2]:.2f}"
            t = _f(r.get("step_time_s"))
            r["vs_plan"] = f"{t / p:.3f}" if t is not None and p else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = [{k: (f"{r[k]:.6g}" if k == "step_time_s" and isinstance(r.get(k), float) else r.get(k, ""))
            for k in FIELDS} for r in rows]
    with open(RESULTS / "suite.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(out)
    summary, _ = summarize(rows)
    images = plots(rows)
    lines = [header, "", "## Goals", "", *summary, "", "## Table", "",
             "| " + " | ".join(FIELDS) + " |", "|" + "---|" * len(FIELDS)]
    lines += ["| " + " | ".join(str(r[k]) for k in FIELDS) + " |" for r in out]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in images]
    (RESULTS / "suite.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=("default", "full", "all"), default="default",
                    help="default: `make bench`'s subset; full: the rest; all: both")
    ap.add_argument("--models", default=None, help="comma-separated filter on the set's models")
    ap.add_argument("--clusters", default=None, help="comma-separated filter: 1x8,2x4,8x8,128x8")
    ap.add_argument("--append", action="store_true",
                    help="keep an existing suite.csv's rows (those of the (model, cluster) pairs run now are replaced)")
    ap.add_argument("--render", action="store_true", help="only rewrite suite.md and the plots from suite.csv")
    ap.add_argument("--time-limit", type=float, default=30.0, help="solver limit per configuration (det. units)")
    args = ap.parse_args(argv)
    cases = {"default": DEFAULT, "full": FULL, "all": DEFAULT + FULL}[args.set]
    if args.models:
        cases = [c for c in cases if c[0] in args.models.split(",")]
    if args.clusters:
        cases = [c for c in cases if c[1] in args.clusters.split(",")]
    header = (f"# Comparison suite (issue 12; {time.strftime('%Y-%m-%d')}; last run --set {args.set}"
              f"{' --append (earlier rows kept)' if args.append else ''}; {PRESET} cost model, "
              f"budget {BUDGET / 1e9:.0f} GB/device; bf16 compute, fp32 master weights)\n\n"
              "mode `compiled`: planned, compiled, read back from the HLO and run one step on 8 CPU devices; "
              "mode `abstract`: cost model only, nothing compiled. Columns: see experiments/bench_suite.py.")
    rows: list[dict] = []
    if (args.append or args.render) and (RESULTS / "suite.csv").exists():
        with open(RESULTS / "suite.csv", newline="") as f:
            rows = [r for r in csv.DictReader(f) if (r["model"], r["cluster"]) not in set(cases)]
    start = time.perf_counter()
    if args.render:
        with open(RESULTS / "suite.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        cases = []
        header = (RESULTS / "suite.md").read_text().split("\n## Goals")[0].rstrip()
    for model, cluster in cases:
        t = time.perf_counter()
        if model in COMPILED_MODELS:
            rows += run_compiled(model, cluster, args.time_limit)
        else:
            rows += run_abstract(model, cluster, args.time_limit)
        print(f"{model} {cluster}: {time.perf_counter() - t:.1f} s (total {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)
        write(rows, header + f"\n\nWall time so far: {time.perf_counter() - start:.0f} s.")
    if args.render:
        write(rows, header)
    summary, _ = summarize(rows)
    print("\n".join(summary[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
