"""Host offload against one real device: the planned program with the Adam moments in pinned host
memory (`offload="opt-state"`) beside the same model planned without offload.

For each model (unsharded on the first local device; bf16 compute, float32 master weights and AdamW
state, state donated), both plans are compiled and run, and each planner figure is put beside the one
XLA compiles or the device measures:
  - host bytes: the plan's offloaded bytes against the compiled program's host-placed arguments
    (`memory_analysis()`'s host_* fields where the backend fills them; the entry layout's S(5)
    buffers otherwise);
  - device memory: the predicted peak against `memory_analysis()` (arguments + outputs + temporaries
    - aliased, without the host-placed buffers);
  - step time: the predicted step time and the predicted cost of offloading (the plan's copies in and
    back at `Hardware.host_bandwidth`: the preset's, and with `--profile` the profile's measured
    link) against the median of timed steps, and the measured difference between the two plans;
  - numerics: the offloaded step's loss and new parameters against the plan without offload (the
    same arithmetic; only placement and order differ), and that plan's against `jax.jit` of the
    step, whose step time is measured too (what users run without the planner).
The compiled program's host transfers are counted (`copy-start` / `copy-done` and the instructions
whose layout names memory space 5).

Usage (on a GPU; on CPU it runs a tiny model as a smoke test, where XLA:CPU compiles no copies):
  python experiments/check_offload.py [--models gpt2-medium ...] [--hardware h200] [--profile P]
      [--out DIR]
Results: DIR/offload_check.json and offload_check.md (default experiments/results/).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import planner  # noqa: E402
from planner.cost_model.hardware import hardware_for_device_kind  # noqa: E402
from check_gpu import _time_steps  # noqa: E402 (experiments/, beside this file)
from xla_hooks.inspect import HOST_MEMORY_SPACE, entry_bytes  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
_BF16 = {"dtype": "bfloat16"}
# Sizes whose moments are large next to the step's compute, so the copies are visible in the time.
GPU_MODELS = {"gpt2-medium": _BF16, "llama-7b": {**_BF16, "layers": 4, "batch": 2}}
CPU_MODELS = {"gpt-tiny": _BF16}
def compiled_figures(compiled) -> dict:
    text = compiled.as_text()
    m = compiled.memory_analysis()
    fields = ("argument", "output", "temp", "alias", "generated_code")
    mem = {f: int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in fields}
    host = {f: int(getattr(m, f"host_{f}_size_in_bytes", 0) or 0) for f in fields}
    host_args, _, host_outs, _ = entry_bytes(text)
    # device bytes: XLA's totals without what it placed on the host (the entry layout's S(5) buffers
    # where the analysis keeps them in the device totals, as XLA:CPU does)
    in_device_totals = not any(host.values())
    device_args = mem["argument"] - (host_args if in_device_totals else 0)
    device_outs = mem["output"] - (host_outs if in_device_totals else 0)
    body = text.split("\n", 1)[1] if "\n" in text else ""
    return {
        "memory": mem, "host_memory": host, "entry_host_argument_bytes": host_args,
        "entry_host_output_bytes": host_outs,
        "device_peak_bytes": device_args + device_outs + mem["temp"] - mem["alias"],
        "copy_start": len(re.findall(r"\bcopy-start\(", body)), "copy_done": len(re.findall(r"\bcopy-done\(", body)),
        "host_space_instructions": sum(1 for line in body.splitlines() if HOST_MEMORY_SPACE in line.split("=", 1)[0]
                                       or re.search(r"= \S+\{[^}]*" + re.escape(HOST_MEMORY_SPACE), line)),
    }


def _max_rel(a, b) -> float:
    """max |a - b| over max |b|, over all leaves of two pytrees (float32 view)."""
    num = den = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        num, den = max(num, float(np.max(np.abs(x - y)))), max(den, float(np.max(np.abs(y))))
    return num / den if den else num


def check(name: str, overrides: dict, hardware: str, profile: str | None, warmup: int, repeats: int,
          offload: str = "opt-state") -> dict:
    b = get_model(name, **overrides)
    device = jax.devices()[0]
    row: dict = {"model": name, "overrides": overrides, "device": device.device_kind, "platform": device.platform,
                 "jax": jax.__version__, "hardware": hardware, "profile": profile, "offload": offload}
    batch = b.make_batch(jax.random.key(1))
    firsts = {}
    for mode in ("off", offload):
        state = b.init_state(jax.random.key(0))
        step = planner.plan_parallel(b.train_step, mesh="1", devices=[device], donate_argnums=(0,),
                                     offload=mode, hardware=hardware)
        t0 = time.perf_counter()
        plan = step.plan(state, batch)
        r: dict = {"plan_s": round(time.perf_counter() - t0, 1)}
        p = plan.prediction
        r.update(predicted_step_s=p.step_time_s, predicted_memory_bytes=int(p.memory_bytes_per_device),
                 predicted_exposed_comm_s=p.communication_time_s, predicted_hidden_comm_s=p.hidden_communication_time_s)
        if profile:  # the same plan's figures with the measured device (its host link among them)
            q = planner.plan(b.train_step, state, batch, mesh="1", devices=[device], donate_argnums=(0,),
                             offload=mode, hardware=hardware, profile=profile)
            r["profiled_step_s"] = q.prediction.step_time_s
            copies = q.levers.offload
            r["profiled_copy_s"] = copies.copy_in_s + copies.copy_back_s if copies is not None else 0.0
        record = plan.levers.offload
        for k in ("host_bytes_per_device", "copy_in_s", "copy_back_s", "hidden_s", "candidates", "streamed"):
            if record is not None:
                r[f"offload_{k}"] = getattr(record, k)
        if record:
            r["offload_leaves"] = len(record.get("inputs", ()))
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        r["compile_s"] = round(time.perf_counter() - t0, 1)
        r.update(compiled_figures(compiled))
        new_state, metrics = step(state, batch)  # the first step, for numerics
        firsts[mode] = (jax.device_get(new_state["params"]), float(metrics["loss"]))
        times = _time_steps(step, new_state, batch, warmup, repeats)
        r["measured_step_s"] = statistics.median(times)
        r["measured_step_s_min"] = min(times)
        row[mode] = r
    # the step as users run it today: jax.jit of the unsharded step, state donated
    state = b.init_state(jax.random.key(0))
    jitted = jax.jit(b.train_step, donate_argnums=(0,))
    new_state, metrics = jitted(state, batch)
    firsts["jit"] = (jax.device_get(new_state["params"]), float(metrics["loss"]))
    times = _time_steps(jitted, new_state, batch, warmup, repeats)
    row["jit_step_s"] = statistics.median(times)
    off, on = row["off"], row[offload]
    row["numerics"] = {"loss_jit": firsts["jit"][1], "loss_off": firsts["off"][1], "loss_offload": firsts[offload][1],
                       "params_max_rel_diff": _max_rel(firsts[offload][0], firsts["off"][0]),
                       "params_max_rel_diff_off_vs_jit": _max_rel(firsts["off"][0], firsts["jit"][0])}
    row["measured_offload_cost_s"] = on["measured_step_s"] - off["measured_step_s"]
    row["predicted_offload_cost_s"] = on["predicted_step_s"] - off["predicted_step_s"]
    if profile:
        row["profiled_offload_cost_s"] = on["profiled_step_s"] - off["profiled_step_s"]
    return row


HEADER = """# Host offload against one device (experiments/check_offload.py)

Each model planned unsharded twice on the device named (bf16 compute, float32 master weights, AdamW,
state donated): without offload and with every Adam moment in pinned host memory
(`offload="opt-state"`). Columns: host bytes (the plan's / XLA's host-placed arguments); device peak
(predicted / `memory_analysis()` without host buffers) for each plan; step time (median of timed
steps after warm-up) and the predicted one for each plan; the cost of offloading, predicted (the
difference of the two predictions) and measured (the difference of the two medians); the compiled
program's async copies (copy-start); the first step's largest parameter difference between the two
plans, and between the plan without offload and `jax.jit` of the step, relative to the largest
parameter; `jax.jit` of the step's own step time.
"""


def markdown(rows: list[dict]) -> str:
    lines = [HEADER.rstrip("\n"), "",
             "| model | device | preset / profile | host bytes plan / XLA | device peak off: pred. / XLA | "
             "device peak offload: pred. / XLA | step off: pred. / measured | step offload: pred. / measured | "
             "offload cost pred. / measured | jax.jit step | copy-start | "
             "params rel. diff (offload vs off; off vs jit) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    gb = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"  # noqa: E731
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error'][:200]} |" + " |" * 10)
            continue
        mode = r.get("offload", "opt-state")
        off, on = r["off"], r[mode]
        xla_host = on["host_memory"]["argument"] or on["entry_host_argument_bytes"]
        model = r["model"] + (f" ({mode})" if mode != "opt-state" else "")
        prices = r["hardware"] + (f" + {pathlib.Path(r['profile']).name}" if r["profile"] else "")
        lines.append(
            f"| {model} | {r['device']} | {prices} | "
            f"{gb(on.get('offload_host_bytes_per_device', 0))} / {gb(xla_host)} | "
            f"{gb(off['predicted_memory_bytes'])} / {gb(off['device_peak_bytes'])} | "
            f"{gb(on['predicted_memory_bytes'])} / {gb(on['device_peak_bytes'])} | "
            f"{ms(off['predicted_step_s'])} / {ms(off['measured_step_s'])} | "
            f"{ms(on['predicted_step_s'])} / {ms(on['measured_step_s'])} | "
            f"{ms(r['predicted_offload_cost_s'])}"
            f"{' (profiled ' + ms(r['profiled_offload_cost_s']) + ')' if 'profiled_offload_cost_s' in r else ''}"
            f" / {ms(r['measured_offload_cost_s'])} | {ms(r['jit_step_s'])} | {on['copy_start']} | "
            f"{r['numerics']['params_max_rel_diff']:.1e}; {r['numerics']['params_max_rel_diff_off_vs_jit']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", help="zoo names (default: gpt2-medium and 4-layer llama-7b on a GPU)")
    ap.add_argument("--hardware", default=None, help="preset for the plans (default: the device kind's, else cpu)")
    ap.add_argument("--profile", default=None, help="a `planner profile` database of this device")
    ap.add_argument("--offload", default="opt-state", choices=("opt-state", "opt-state+params"),
                    help="what the offloaded plan keeps on the host (default: the Adam moments)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    table = GPU_MODELS if device.platform == "gpu" else CPU_MODELS
    names = args.models or list(table)
    preset = hardware_for_device_kind(device.device_kind)
    hardware = args.hardware or (preset.name if preset else "cpu")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows.append(check(name, table.get(name, _BF16), hardware, args.profile, args.warmup, args.repeats,
                              args.offload))
        except Exception as e:  # noqa: BLE001 - a failed model is a row of the report, the others still run
            traceback.print_exc()
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        (out / "offload_check.json").write_text(json.dumps(rows, indent=1, default=str))
        (out / "offload_check.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
