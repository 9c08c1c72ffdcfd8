"""Predicted against published training throughput: Megatron-LM's GPT runs on A100 clusters.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21 (arXiv:2104.04473), Table 1 (the rows below; weak scaling, 1.7B to 145.6B
parameters). Their setup: sequence length 2048, vocabulary 51,200, mixed precision, activation
recomputation on, DGX A100 80 GB nodes of 8 GPUs (NVLink/NVSwitch inside a node, 8 x 200 Gbit/s
HDR InfiniBand per node, i.e. 25 GB/s per GPU: the a100-80gb preset's links). Throughput is counted
with their Eq. 3, the FLOPs of one iteration with recomputation:

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))

For each row this prints, as TFLOP/s per GPU (F / predicted step time / GPUs):
  - published: the published configuration itself (TP x PP x DP laid out as Megatron lays it
    out: `planner.evaluate(..., baseline="megatron-tp+ppP", tensor_parallel=T, remat=True)`,
    costed by the planner's pipeline path), and its ratio to the measured figure;
  - planner: the planner's own best plan on the same cluster at the same batch
    (`planner.stages.plan_pipeline`, pipeline "auto"; stages, meshes, microbatches, remat chosen),
    and its ratio to the measured figure;
  - planning time of each.
No per-row constant is fitted: every figure comes from the presets (their sources are cited in
planner/cost_model/hardware.py) and the planner's cost model.

Run (abstract planning, cost model only; minutes per row on 2 CPU cores):
    .venv/bin/python experiments/validate_published.py [--rows 1.7B,3.6B] [--microbatch-limit 4]
Results: experiments/results/published.json, published.md and published.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import planner  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.options import PlanOptions  # noqa: E402
from planner.stages import make_cluster, plan_pipeline  # noqa: E402
from zoo import get_model  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
SEQ, VOCAB = 2048, 51200
HARDWARE = "a100-80gb"


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of Narayanan et al. (SC21), Table 1."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    measured_tflops: float  # achieved teraFLOP/s per GPU, as published

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def flops(self) -> float:
        """Eq. 3 of the paper: FLOPs of one iteration (forward, backward, recomputed forward)."""
        b, s, l, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


ROWS = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
)


def _bundle(row: Row, dtype: str):
    return get_model("gpt3-1.3b", batch=row.batch, seq=SEQ, vocab=VOCAB, d_model=row.hidden, heads=row.heads,
                     layers=row.layers, dtype=dtype)


def _tflops(row: Row, step_s: float | None) -> float | None:
    if step_s is None or not math.isfinite(step_s) or step_s <= 0:
        return None
    return row.flops() / step_s / row.gpus / 1e12


def published(row: Row, bundle, microbatch_size: int) -> dict:
    """The published configuration, costed by the planner's pipeline path: Megatron-style tensor
    parallelism `row.tp` ways inside a host, `row.pp` even stages across hosts, data parallelism on
    the rest, recomputation on, microbatches of `microbatch_size` sequences per data-parallel rank
    (Table 1 does not list the microbatch size)."""
    t0 = time.perf_counter()
    try:
        plan = planner.evaluate(bundle.train_step, bundle.abstract_state(), bundle.abstract_batch(),
                                baseline=f"{'megatron-tp' if row.tp > 1 else 'dp'}+pp{row.pp}",
                                tensor_parallel=row.tp if row.tp > 1 else None,
                                cluster=f"{row.gpus // 8}x8:{HARDWARE}", remat=True,
                                num_microbatches=row.batch // (row.dp * microbatch_size))
    except (PlannerError, TypeError) as e:
        return {"error": str(e).splitlines()[0], "planning_s": round(time.perf_counter() - t0, 1)}
    pred = plan.prediction
    return {"step_s": pred.step_time_s, "planning_s": round(time.perf_counter() - t0, 1),
            "memory_gb": pred.memory_bytes_per_device / 1e9,
            "microbatches": (plan.pipeline or {}).get("num_microbatches"),
            # `Prediction.communication_time_s` is the exposed part already (step = compute + it)
            "exposed_comm_s": pred.communication_time_s, "hidden_comm_s": pred.hidden_communication_time_s}


def planners_own(row: Row, bundle, microbatch_limit: int, num_microbatches: int | None = None) -> dict:
    """The planner's own best plan: stages, meshes, microbatches and remat chosen (`num_microbatches`:
    the count fixed, the rest chosen)."""
    cluster = make_cluster(row.gpus // 8, 8, HARDWARE)
    t0 = time.perf_counter()
    try:
        pp = plan_pipeline(bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch()), cluster,
                           PlanOptions(pipeline="auto", num_microbatches=num_microbatches),
                           microbatch_limit=microbatch_limit)
    except PlannerError as e:
        return {"error": str(e).splitlines()[0], "planning_s": round(time.perf_counter() - t0, 1)}
    return {"step_s": pp.step_time_s, "planning_s": round(time.perf_counter() - t0, 1),
            "counts_tried": [b for b, _, _ in pp.candidates],  # 1: the single stage
            "stages": pp.num_stages, "microbatches": pp.num_microbatches,
            "memory_gb": pp.memory_bytes_per_device / 1e9,
            "layouts": [f"{st.mesh_shape}{'+remat' if st.remat else ''}" for st in pp.stages]
            if all(hasattr(st, "mesh_shape") for st in pp.stages) else None}


def time_split(row: Row, dtype: str) -> dict:
    """Where the cost model puts the time of one sequence's forward and backward (the gradient, without
    the optimizer update, which runs once per step) on one A100, by op
    class: contractions (dot, convolution), elementwise and reduction ops on the attention scores
    (tensors ending in [seq, seq]), and the other non-contraction ops (memory-bound: layer norms,
    GELU, residual adds, conversions, the loss). Each op is priced as the planner prices it
    (`enumerate_strategies` on a one-device mesh: roofline at the achieved matmul rate, memory
    traffic at fusion boundaries, `planner.fusion`). Layers are identical, so the split of L layers
    is the split of 2 layers plus (L - 2) times the difference between 3 and 2 layers."""
    import jax

    from planner.cost_model import CostModel, get_hardware
    from planner.fusion import fusions
    from planner.graph import trace
    from planner.ilp.rules import signature
    from planner.ilp.strategies import enumerate_strategies, is_contraction
    from planner.mesh import MeshSpec

    cost = CostModel.default(MeshSpec((1,), ("x",)), get_hardware(HARDWARE))

    def split(layers: int) -> dict[str, float]:
        b = get_model("gpt3-1.3b", batch=1, seq=SEQ, vocab=VOCAB, d_model=row.hidden, heads=row.heads,
                      layers=layers, dtype=dtype)
        # The gradient alone: the optimizer update runs once per step, not once per sequence.
        g = trace(jax.grad(b.loss_fn), b.abstract_state()["params"], b.abstract_batch())
        traffic = fusions(g, cost.hardware.platform)
        out = {"matmul": 0.0, "attention scores": 0.0, "other memory-bound": 0.0}
        for op in g.ops:
            ins = [g.tensors[x] if isinstance(x, int) else None for x in op.inputs]
            outs = [g.tensors[t] for t in op.outputs]
            sig = signature(op, g)
            tr = traffic[op.index]
            (st,) = enumerate_strategies(sig, ins, outs, cost, traffic=(tr.reads, tr.writes))[:1]
            if is_contraction(sig, ins, outs):
                out["matmul"] += st.cost
            elif any(t is not None and t.shape[-2:] == (SEQ, SEQ) for t in ins + outs):
                out["attention scores"] += st.cost
            else:
                out["other memory-bound"] += st.cost
        return out

    two, three = split(2), split(3)
    total = {k: two[k] + (row.layers - 2) * (three[k] - two[k]) for k in two}
    whole = sum(total.values())
    return {k: v / whole for k, v in total.items()}


def run_row(row: Row, args) -> dict:
    bundle = _bundle(row, args.dtype)
    out = {"row": row.name, "tp": row.tp, "pp": row.pp, "dp": row.dp, "gpus": row.gpus, "batch": row.batch,
           "measured_tflops": row.measured_tflops, "flops_per_iteration": row.flops()}
    out["published"] = published(row, bundle, args.microbatch_size)
    out["time_split"] = time_split(row, args.dtype)
    if row.gpus <= args.planner_max_gpus:
        out["planner"] = planners_own(row, bundle, args.microbatch_limit)
    else:
        out["planner"] = {"error": f"not run (--planner-max-gpus {args.planner_max_gpus})"}
    slower = out["planner"].get("step_s", 0.0) > out["published"].get("step_s", math.inf)
    count = out["published"].get("microbatches")
    if slower and count and count not in out["planner"].get("counts_tried", ()):
        # the planner's search did not try the published microbatch count: its search at that count
        out["planner_at_published_count"] = planners_own(row, bundle, args.microbatch_limit, count)
    for key in ("published", "planner", "planner_at_published_count"):
        if key not in out:
            continue
        t = _tflops(row, out[key].get("step_s"))
        out[key]["tflops_per_gpu"] = t
        out[key]["ratio_to_measured"] = None if t is None else t / row.measured_tflops
    return out


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _split(r: dict) -> str:
    sp = r.get("time_split")
    if not sp:
        return "-"
    return " / ".join(f"{sp[k]:.0%}" for k in ("matmul", "attention scores", "other memory-bound"))


def _implied(r: dict) -> float | None:
    """The factor f by which the measured run's non-matmul work would be faster than predicted if the
    prediction's matmul share m were exact: measured / predicted time = ratio = m + f (1 - m)."""
    sp, ratio = r.get("time_split"), r["published"].get("ratio_to_measured")
    if not sp or ratio is None or sp["matmul"] >= 1:
        return None
    return (ratio - sp["matmul"]) / (1 - sp["matmul"])


REASON = """
Where the remaining error is. The "share" column splits the predicted time of one sequence's
forward and backward on one A100 (experiments/validate_published.py `time_split`): matmuls at the
cited achieved rate, and memory-bound ops (the attention scores' elementwise and reduction ops over
[seq, seq] tensors, and the rest: layer norms, GELU, residual adds, conversions, the loss) at memory
bandwidth with traffic counted at fusion boundaries the way XLA:GPU groups fusions (planner/fusion.py:
cheap producers such as the softmax's float32 exp recomputed in each consuming fusion where that
saves traffic, as XLA:GPU's instruction and priority fusion do). The error tracks the memory-bound
share: it is largest for the smallest model (1.7B: 35% of the predicted time is memory-bound, 18
points of it on the attention scores; hidden size 2304, 24 heads) and small from 3.6B up. If the
matmul time were exact, the measured step would need the memory-bound work to run f times its
predicted time ("implied non-matmul factor"): 0.40 for 1.7B, where Megatron-LM's hand-fused CUDA
kernels (fused scale-mask-softmax: one read and one write of the scores forward, fused bias-GELU,
fused layer norm) read and write each tensor fewer times than XLA's generic fusions the model
follows. Not modelled: XLA:GPU's Triton softmax and cuDNN attention fusions, dot epilogues, and
multi-output sibling fusions (on an H100 the grouping's bytes were 1.28-1.64x XLA's `bytes accessed`
for the zoo's models, experiments/results/gpu_check.md). No per-row constant is fitted. The planner's own plan for 1.7B (2 stages, no
recomputation) is credited Eq. 3's recomputation FLOPs it does not run, as any plan that fits
without recomputation is: its ratio to the measured figure is not an accuracy figure.
"""


def write_table(results: list[dict]) -> str:
    lines = ["Megatron-LM SC21 Table 1 (A100 80 GB, seq 2048): measured vs predicted TFLOP/s per GPU "
             "(experiments/validate_published.py)", "",
             "| row | TP | PP | DP | GPUs | batch | measured | published config predicted | ratio | planner's plan "
             "predicted | ratio | planning s (published / planner) | matmul / attention scores / other share "
             "| implied non-matmul factor | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        pub, own = r["published"], r["planner"]
        note = "; ".join(f"{k}: {v['error']}" for k, v in (("published", pub), ("planner", own)) if "error" in v)
        same = r.get("planner_at_published_count")
        if same is not None:
            tried = own.get("counts_tried", ())
            note += ("; " if note else "") + (f"planner slower: the microbatch counts it tried "
                     f"({', '.join(map(str, tried))}; --microbatch-limit; 1: the single stage) miss the published "
                     f"{pub.get('microbatches')}; its search at {pub.get('microbatches')} microbatches: "
                     f"{_fmt(same.get('tflops_per_gpu'))} TFLOP/s per GPU"
                     + (f" ({same['error']})" if "error" in same else
                        f" ({same.get('stages')} stages, {same.get('step_s', 0):.2f} s/step)"))
        lines.append(f"| {r['row']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['gpus']} | {r['batch']} | "
                     f"{r['measured_tflops']:.0f} | {_fmt(pub.get('tflops_per_gpu'))} | "
                     f"{_fmt(pub.get('ratio_to_measured'), '.2f')} | {_fmt(own.get('tflops_per_gpu'))} | "
                     f"{_fmt(own.get('ratio_to_measured'), '.2f')} | {_fmt(pub.get('planning_s'))} / "
                     f"{_fmt(own.get('planning_s'))} | {_split(r)} | {_fmt(_implied(r), '.2f')} | {note} |")
    errs = [abs(r["published"]["ratio_to_measured"] - 1) for r in results
            if r["published"].get("ratio_to_measured") is not None]
    if errs:
        errs.sort()
        median = errs[len(errs) // 2] if len(errs) % 2 else 0.5 * (errs[len(errs) // 2 - 1] + errs[len(errs) // 2])
        lines += ["", f"Published configurations: median |error| {median:.1%}, worst {max(errs):.1%} over "
                      f"{len(errs)} row(s) (goal: 10% median, 20% worst)."]
    both = [r for r in results if r["published"].get("step_s") is not None and r["planner"].get("step_s") is not None]
    if both:
        ok = [r for r in both if r["planner"]["step_s"] <= r["published"]["step_s"]]
        lines.append(f"The planner's own plan predicted at least as fast as the published configuration: {len(ok)} of "
                     f"{len(both)} row(s) (goal: every row)" + ("." if len(ok) == len(both) else
                     "; slower: " + ", ".join(r["row"] for r in both if r not in ok) + " (see the note column)."))
    if any(r.get("time_split") for r in results):
        lines.append(REASON)
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for key, marker in (("published", "o"), ("planner", "s")):
        pts = [(r["measured_tflops"], r[key]["tflops_per_gpu"], r["row"]) for r in results
               if r[key].get("tflops_per_gpu") is not None]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                       label="published configuration" if key == "published" else "planner's plan")
            for x, y, name in pts:
                ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    lo, hi = 0, 1.3 * max([r["measured_tflops"] for r in results] + [
        r[k].get("tflops_per_gpu") or 0 for r in results for k in ("published", "planner")])
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="prediction = measurement")
    ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="0.9", label="+-10%")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured TFLOP/s per GPU (Megatron-LM, SC21 Table 1)")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", help="comma-separated row names (default: all), e.g. 1.7B,39.1B; the other rows of "
                   "an existing published.json are kept")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--microbatch-size", type=int, default=1,
                   help="sequences per data-parallel rank in one microbatch of the published configuration")
    p.add_argument("--microbatch-limit", type=int, default=4,
                   help="microbatch counts the planner's own search tries (spread in log scale)")
    p.add_argument("--planner-max-gpus", type=int, default=1 << 30,
                   help="run the planner's own search only on rows with at most this many GPUs (it plans "
                        "every submesh of the cluster: minutes per row at 64 hosts on 2 cores)")
    p.add_argument("--out", default=str(RESULTS), help="directory for published.{json,md,png}")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    wanted = set(args.rows.split(",")) if args.rows else None
    rows = [r for r in ROWS if wanted is None or r.name in wanted]
    if wanted and len(rows) != len(wanted):
        p.error(f"unknown rows {sorted(wanted - {r.name for r in rows})}; known: {[r.name for r in ROWS]}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    # With --rows, the other rows of an existing published.json are kept (the table and plot show all).
    kept = json.loads((out / "published.json").read_text()) if wanted and (out / "published.json").exists() else []
    order = [r.name for r in ROWS]

    def merged() -> list[dict]:
        done = {r["row"]: r for r in results}
        return sorted([r for r in kept if r["row"] not in done] + results, key=lambda r: order.index(r["row"]))

    for row in rows:
        print(f"[{len(results) + 1}/{len(rows)}] {row.name}: TP {row.tp} PP {row.pp} DP {row.dp} on {row.gpus} GPUs, "
              f"batch {row.batch} ...", flush=True)
        results.append(run_row(row, args))
        r = results[-1]
        print(f"    measured {row.measured_tflops:.0f}; published config predicted "
              f"{_fmt(r['published'].get('tflops_per_gpu'))} ({r['published'].get('error', 'ok')}); planner "
              f"{_fmt(r['planner'].get('tflops_per_gpu'))} TFLOP/s per GPU", flush=True)
        (out / "published.json").write_text(json.dumps(merged(), indent=1, default=str) + "\n")
        (out / "published.md").write_text(write_table(merged()))
    plot(merged(), out / "published.png")
    print(write_table(merged()))
    return merged()


if __name__ == "__main__":
    main()
