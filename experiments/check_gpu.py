"""The cost model against one real accelerator: fusion grouping, memory traffic, memory and step time.

Runs the zoo's models (bf16 compute, float32 parameters and AdamW state, the zoo's default) unsharded
on the first local device and puts beside each figure the planner predicts the one XLA compiles or
the device measures:
  - kernels: the planner's fusion grouping (`planner.graph.fusion.fusions` under the platform's rules)
    counted as kernels (fusions plus unfused ops) against the kernels of the compiled HLO (fusions,
    library calls, other top-level instructions);
  - memory traffic: the grouping's bytes (`memory_traffic_bytes`, the bytes the cost model charges)
    against XLA's own cost analysis (`bytes accessed`), under the platform's rules and the other
    platform's, to see which grouping XLA's output is closer to;
  - memory: the predicted per-device peak against `memory_analysis()`;
  - step time: the predicted step time (the hardware preset of the device; with `--profile`, also the
    hardware the profile measured) against the median of timed steps (donated state, after warm-up).

Usage (on a GPU machine; on CPU it runs the tiny models as a smoke test):
  python experiments/check_gpu.py [--models gpt2-small ...] [--profile prof.json] [--out DIR]
Device time is scarce: measure there and predict anywhere (the prediction needs no device):
  on the device:  python experiments/check_gpu.py --measure-only --out DIR [--trace T --dump-hlo H]
  anywhere:       python experiments/check_gpu.py --predict-from DIR/gpu_check.json \
                      --profile results/profile_h100.json --traces results/gpu_traces
Results: DIR/gpu_check.json and gpu_check.md (default experiments/results/). The committed rows
were measured on one H100 80GB HBM3 with jax 0.11.2 in two runs ("measured_in").
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import statistics
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from planner.graph.fusion import fusible, fusions, memory_traffic_bytes  # noqa: E402
from planner.graph.trace import trace  # noqa: E402
from planner.core.mesh import MeshSpec  # noqa: E402
from planner.core.options import PlanOptions  # noqa: E402
from planner.search.mesh_plan import make_plan  # noqa: E402
from xla_hooks.inspect import kernels, report  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
# Sizes that fit one 80 GB device unsharded (float32 master weights and AdamW moments, bf16 compute).
# Most important first: a run cut short keeps the rows it finished.
_BF16 = {"dtype": "bfloat16"}
GPU_MODELS = {
    "gpt2-medium": _BF16,
    "llama-7b": {**_BF16, "layers": 4, "batch": 2},
    "bert-large": _BF16,
    "wresnet-50-2": _BF16,
    "gshard-moe-1.3b": {**_BF16, "layers": 4},
    "gpt2-small": _BF16,
    "gpt3-1.3b": {**_BF16, "batch": 1},
}
CPU_MODELS = {"gpt-tiny": _BF16, "llama-tiny": _BF16}

def predicted_kernels(graph, platform: str, traffic) -> dict[str, int]:
    """The grouping's kernels (`traffic`: `fusions(graph, platform)`): fusions of fusible ops, and
    each other op (dots, convolutions, ...) as a kernel of its own."""
    fused, other = set(), 0
    for i, op in enumerate(graph.ops):
        if fusible(op.name, platform):
            fused.update(traffic[i].fusions)
        else:
            other += 1
    return {"fusions": len(fused), "unfused ops": other}


def _time_steps(step, state, batch, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, overrides: dict, warmup: int, repeats: int, dump_hlo: str | None = None,
            trace_dir: str | None = None) -> dict:
    """The device's side of a row: the compiled program's figures and the measured step time."""
    b = get_model(name, **overrides)
    state, batch = b.init_state(jax.random.key(0)), b.make_batch(jax.random.key(1))
    row: dict = {"model": name, "overrides": overrides, "device": jax.devices()[0].device_kind,
                 "platform": jax.devices()[0].platform, "jax": jax.__version__}
    t0 = time.perf_counter()
    compiled = jax.jit(b.train_step, donate_argnums=(0,)).lower(state, batch).compile()
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    rep = report(compiled)
    text = compiled.as_text()
    if dump_hlo:
        pathlib.Path(dump_hlo).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(dump_hlo) / f"{name}.hlo.txt").write_text(text)
    row["compiled_kernels"] = kernels(text)
    row["compiled_bytes"] = rep.bytes_accessed
    row["compiled_flops"] = rep.flops
    row["compiled_memory_bytes"] = rep.memory.peak_bytes if rep.memory else None
    times = _time_steps(compiled, state, batch, warmup, repeats)
    row["measured_step_s"] = statistics.median(times)
    row["measured_step_s_min"] = min(times)
    if trace_dir:
        state = b.init_state(jax.random.key(0))  # the timed steps took the donated state
        with jax.profiler.trace(str(pathlib.Path(trace_dir) / name), create_perfetto_trace=True):
            _time_steps(compiled, state, batch, 0, 3)
    return row


def predict(row: dict, hardware: str, profile: str | None) -> dict:
    """The planner's side of a row, planned without devices (so the memory model is the one of the
    hardware's platform, not of this machine's): fusion grouping, bytes, memory and step time."""
    platform = row.get("platform", "gpu")
    other = "cpu" if platform == "gpu" else "gpu"
    b = get_model(row["model"], **row["overrides"])
    graph = trace(b.train_step, b.abstract_state(), b.abstract_batch())
    traffic = fusions(graph, platform)
    out = {"predicted_kernels": predicted_kernels(graph, platform, traffic),
           "predicted_bytes": memory_traffic_bytes(graph, traffic),
           f"predicted_bytes_{other}_rules": memory_traffic_bytes(graph, fusions(graph, other))}
    mesh = MeshSpec((1,), ("x",))
    plans = {"preset": make_plan(graph, mesh, PlanOptions(hardware=hardware, donate_argnums=(0,)))}
    if profile:
        plans["profiled"] = make_plan(graph, mesh, PlanOptions(hardware=hardware, profile=profile, donate_argnums=(0,)))
    for key, plan in plans.items():
        p = plan.prediction
        out[f"{key}_step_s"] = p.step_time_s
        out[f"{key}_compute_s"] = p.compute_time_s
        out[f"{key}_memory_bytes"] = int(p.memory_bytes_per_device)
        out[f"{key}_ratio"] = round(p.step_time_s / row["measured_step_s"], 3)
    if row.get("compiled_flops"):
        out["measured_tflops"] = round(row["compiled_flops"] / row["measured_step_s"] / 1e12, 1)
    return out


def trace_summary(path: pathlib.Path, steps: int = 3) -> dict:
    """Per step, from a profiler trace (`--trace`) of `steps` steps: the device's busy time and its
    split by kernel kind (library GEMMs, XLA's fusions by kind, copies)."""
    events = json.loads(gzip.open(path).read())["traceEvents"]
    device = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    kinds: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device:
            continue
        name = e["name"]
        low = name.lower()
        if any(k in low for k in ("nvjet", "cutlass", "sm90", "gemm", "xmma", "cublas")):
            kind = "gemm"
        elif low.startswith(("loop_", "input_", "fusion", "wrapped_", "triton")):
            kind = name.split("_")[0] if "_" in name else "fusion"
        elif "memcpy" in low or "memset" in low or low.startswith("copy"):
            kind = "copy"
        else:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] * 1e-6 / steps
    return {"busy_s": sum(kinds.values()), "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def _fmt_trace(r: dict) -> str:
    t = r.get("trace")
    if not t:
        return ""
    return f" (busy {t['busy_s'] * 1e3:.1f}, GEMMs {t['by_kind_s'].get('gemm', 0.0) * 1e3:.1f})"


def _fmt_kernels(d: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


HEADER = """# The cost model against one device (experiments/check_gpu.py)

Unsharded train steps (bf16 compute, float32 master weights, AdamW, state donated) measured on the
device named in each row; predictions made afterwards without devices (the platform's rules).
Columns: measured step time (median of 10 after 3 warm-ups; busy: the device's kernel time per step
in the profiler trace, and its library GEMMs); predicted step time with the hardware preset and with
the profile measured on that device (`planner profile`), each with its ratio to the measured time;
TFLOP/s: XLA's FLOP count over the measured time; bytes: the fusion grouping's memory traffic (this
platform's rules, and the other platform's) over XLA's `bytes accessed`; memory: the predicted peak
over `memory_analysis()`; kernels: the grouping's fusions and unfused ops, and the compiled program's
top-level kernels by kind.

"""


def markdown(rows: list[dict]) -> str:
    lines = [HEADER.rstrip("\n"), "",
             "| model | device | measured s/step | preset pred. (ratio) | profiled pred. (ratio) | TFLOP/s | "
             "bytes pred./XLA | other rules/XLA | memory pred./XLA | kernels pred. | kernels XLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'][:200]} |" + " |" * 9)
            continue
        other = next(k for k in r if k.startswith("predicted_bytes_") and k.endswith("_rules"))
        prof = (f"{r['profiled_step_s'] * 1e3:.1f} ms ({r['profiled_ratio']:.2f})" if "profiled_step_s" in r
                else "-")
        xla_bytes = r["compiled_bytes"] or float("nan")
        mem = r["compiled_memory_bytes"] or float("nan")
        lines.append(
            f"| {r['model']} | {r['device']} | {r['measured_step_s'] * 1e3:.1f} ms{_fmt_trace(r)} | "
            f"{r['preset_step_s'] * 1e3:.1f} ms ({r['preset_ratio']:.2f}) | {prof} | {r.get('measured_tflops', '-')} | "
            f"{r['predicted_bytes'] / xla_bytes:.2f} | {r[other] / xla_bytes:.2f} | "
            f"{r['preset_memory_bytes'] / mem:.2f} | {_fmt_kernels(r['predicted_kernels'])} | "
            f"{_fmt_kernels(r['compiled_kernels'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="zoo names (default: sizes for one 80 GB GPU, tiny ones on CPU)")
    ap.add_argument("--hardware", default=None, help="preset for the prediction (default: h100 for a GPU's rows)")
    ap.add_argument("--profile", default=None, help="a `planner profile` database of the measured device")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--dump-hlo", default=None, help="write each compiled program's HLO text to this folder")
    ap.add_argument("--trace", default=None, help="write a profiler trace of 3 steps per model to this folder")
    ap.add_argument("--measure-only", action="store_true",
                    help="only measure on this device (predict later, on any machine, with --predict-from)")
    ap.add_argument("--traces", default=None,
                    help="with --predict-from: a folder of MODEL.json.gz traces to summarise in the rows")
    ap.add_argument("--predict-from", default=None,
                    help="a gpu_check.json measured earlier: add the planner's predictions to its rows")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.predict_from:
        rows = [r for r in json.loads(pathlib.Path(args.predict_from).read_text())
                if not args.models or r["model"] in args.models]
    else:
        gpu = jax.devices()[0].platform == "gpu"
        table = GPU_MODELS if gpu else CPU_MODELS
        models = {m: {**GPU_MODELS, **CPU_MODELS}.get(m, {}) for m in args.models} if args.models else table
        rows = []
        for name, overrides in models.items():
            print(f"== {name} {overrides}", flush=True)
            try:
                row = measure(name, overrides, args.warmup, args.repeats, args.dump_hlo, args.trace)
            except Exception as e:  # a model that does not fit or compile is a row, not the end of the run
                row = {"model": name, "overrides": overrides, "error": f"{type(e).__name__}: {e}"[:2000],
                       "traceback": traceback.format_exc().splitlines()[-12:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
            (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
    if not args.measure_only:
        for row in rows:
            if "error" not in row:
                hardware = args.hardware or ("h100" if row.get("platform", "gpu") == "gpu" else "cpu")
                row.update(predict(row, hardware, args.profile))
                found = pathlib.Path(args.traces or "/nonexistent") / f"{row['model']}.json.gz"
                if found.exists():
                    row["trace"] = trace_summary(found)
        (out / "gpu_check.json").write_text(json.dumps(rows, indent=1))
        (out / "gpu_check.md").write_text(markdown(rows))
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
