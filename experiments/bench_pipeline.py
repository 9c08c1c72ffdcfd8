"""Benchmark: inter-op planning of GPT-39B on Alpa's testbed (8 hosts x 8 V100, 25 Gbit/s between hosts).

    python experiments/bench_pipeline.py                      # GPT-39B, bfloat16 activations, B chosen
    python experiments/bench_pipeline.py --microbatches 8     # B fixed, as Alpa's benchmark does
    python experiments/bench_pipeline.py --dtype float32 --json /tmp/pp.json
    python experiments/bench_pipeline.py --model llama-70b --hosts 128 --hardware h100 \
        --inter-host-gbit 0 --batch 1024 --unrolled     # Llama-70B on 1024 H100 (preset links)

Planning is abstract (ShapeDtypeStructs; nothing is allocated). It prints the chosen stages, the
predicted step time against the best single-stage plan, and where the planning time went. Alpa
reported ~40 minutes to plan this model on 64 GPUs; the target here is under 120 s on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zoo import get_model  # noqa: E402
from planner.core.options import PlanOptions  # noqa: E402
from planner.stages.submesh import make_cluster  # noqa: E402
from planner.stages.inter_op import plan_pipeline  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt3-39b")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype (Alpa trained in mixed precision)")
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--devices-per-host", type=int, default=8)
    p.add_argument("--hardware", default="v100-16gb")
    p.add_argument("--inter-host-gbit", type=float, default=25.0,
                   help="one host's network in Gbit/s (Alpa's testbed: 25); 0: the preset's link")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the zoo model's)")
    p.add_argument("--unrolled", action="store_true",
                   help="unroll scanned layers (scan_layers=False): a stage then owns its layers' weights")
    p.add_argument("--microbatches", type=int, default=None, help="default: the planner chooses")
    p.add_argument("--microbatch-limit", type=int, default=None,
                   help="try this many microbatch counts, spread in log scale (default: every divisor)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    p.add_argument("--pipeline", default="auto", choices=("auto", "true"))
    p.add_argument("--mesh-ndim", type=int, default=2, choices=(1, 2))
    p.add_argument("--json", help="write the result here")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")

    bundle = get_model(args.model, dtype=args.dtype, **({"batch": args.batch} if args.batch else {}),
                       **({"scan_layers": False} if args.unrolled else {}))
    cluster = make_cluster(args.hosts, args.devices_per_host, args.hardware,
                           inter_host_gbit=args.inter_host_gbit or None)
    options = PlanOptions(pipeline=True if args.pipeline == "true" else "auto",
                          num_microbatches=args.microbatches, schedule=args.schedule)
    start = time.perf_counter()
    pp = plan_pipeline(bundle.train_step, (bundle.abstract_state(), bundle.abstract_batch()), cluster, options,
                       max_mesh_ndim=args.mesh_ndim, microbatch_limit=args.microbatch_limit)
    elapsed = time.perf_counter() - start

    print(f"{args.model} ({args.dtype} activations, batch {bundle.config.batch}) on {cluster}, "
          + (f"{args.inter_host_gbit:g} Gbit/s between hosts" if args.inter_host_gbit else "preset links"))
    print(pp.summary())
    hosts_aligned = all(st.devices[0] % args.devices_per_host == 0 and len(st.devices) % args.devices_per_host == 0
                        for st in pp.stages)
    single = pp.single_stage_time_s
    print(f"  stage boundaries on host boundaries: {hosts_aligned}")
    if single is not None:
        free = pp.single_stage_time_unconstrained_s
        print(f"  pipeline vs best single stage: {pp.step_time_s:.3f} s vs "
              f"{'does not fit' if single == float('inf') else f'{single:.3f} s'}"
              f" (ignoring memory: {free:.3f} s, {free / pp.step_time_s:.2f}x the pipeline's time)")
    print(f"  microbatch counts tried (B, step s, stages): {[(b, round(t, 4), s) for b, t, s in pp.candidates]}")
    print(f"  planning time {elapsed:.1f} s: " + ", ".join(f"{k}={v}" for k, v in pp.planning.to_json().items()))
    result = {
        "model": args.model, "dtype": args.dtype, "cluster": str(cluster), "inter_host_gbit": args.inter_host_gbit,
        "planning_time_s": round(elapsed, 2), "hosts_aligned": hosts_aligned, **pp.facts().to_json(),
        "stages": [s.to_json() for s in pp.stage_records()],
    }
    for s in result["stages"]:
        s.pop("shardings")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
