"""Recomputation in single-stage plans (planner/levers/remat.py): predicted vs XLA:CPU's compiled peak.

For each model and policy (off / dots / full): the planned program's predicted per-device peak, the
compiled one (`memory_analysis`), their ratio, the predicted step and compute time and the number of
dots in the compiled HLO (the recomputation, made visible). Also the unsharded 8-layer MLP of the
issue's measurement (x 2048x256, w1 256x1024), compiled straight from the rewritten graph.

    .venv/bin/python experiments/check_remat.py [--out experiments/results/remat.json]
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import planner  # noqa: E402
from planner.graph.trace import trace  # noqa: E402
from planner.levers.remat import rematerialize  # noqa: E402
from xla_hooks.inspect import memory_stats  # noqa: E402
from zoo import get_model  # noqa: E402

CASES = [("gpt-tiny", dict(layers=2, batch=16, seq=64), "1x8"),
         ("gpt-tiny", dict(layers=4, batch=16, seq=64), "1x8"),
         ("gpt-tiny", dict(layers=4, batch=16, seq=64), "2x4"),
         ("gpt-tiny", dict(layers=2, batch=16, seq=64, dtype="bfloat16"), "1x8")]


def dots(compiled) -> int:
    return len(re.findall(r" dot\(", compiled.as_text()))


def planned_rows():
    for name, overrides, mesh in CASES:
        b = get_model(name, **overrides)
        state, batch = b.abstract_state(), b.abstract_batch()
        for remat in ("off", "dots", "full"):
            step = planner.plan_parallel(b.train_step, mesh=mesh, remat=remat)
            plan = step.plan(state, batch)
            compiled = step.lower(state, batch).compile()
            predicted, measured = plan.prediction.memory_bytes_per_device, memory_stats(compiled).peak_bytes
            yield {"model": name, "shape": overrides, "mesh": mesh, "remat": remat, "predicted_bytes": predicted,
                   "compiled_bytes": measured, "ratio": round(predicted / measured, 3),
                   "step_time_s": plan.prediction.step_time_s, "compute_time_s": plan.prediction.compute_time_s,
                   "dots": dots(compiled)}


def mlp_rows():
    def layer(w, x):
        w1, w2 = w
        return x + jnp.tanh(jax.nn.gelu(x @ w1) @ w2)

    def loss(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"blocks_{i}"):
                x = layer(w, x)
        return jnp.sum(x ** 2)

    ws = [(jax.ShapeDtypeStruct((256, 1024), jnp.float32), jax.ShapeDtypeStruct((1024, 256), jnp.float32))] * 8
    x = jax.ShapeDtypeStruct((2048, 256), jnp.float32)
    graph = trace(jax.grad(loss), ws, x)
    flat = jax.tree_util.tree_leaves((ws, x))
    for remat in ("off", "dots", "full"):
        g = graph if remat == "off" else rematerialize(graph, None, remat)
        compiled = jax.jit(lambda *a, g=g: g.evaluate(list(a))).lower(*flat).compile()
        yield {"model": "mlp-8x(2048x256->1024)", "mesh": "1 device", "remat": remat,
               "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "dots": dots(compiled)}
    for name, fn in (("jax.checkpoint", jax.checkpoint(layer)),):
        def ckpt_loss(ws, x, fn=fn):
            for w in ws:
                x = fn(w, x)
            return jnp.sum(x ** 2)
        compiled = jax.jit(jax.grad(ckpt_loss)).lower(ws, x).compile()
        yield {"model": "mlp-8x(2048x256->1024)", "mesh": "1 device", "remat": name,
               "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "dots": dots(compiled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for row in list(mlp_rows()) + list(planned_rows()):
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
