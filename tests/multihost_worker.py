"""One process of the multi-host test (run by tests/test_multihost.py, not collected by pytest).

Usage: python tests/multihost_worker.py PORT PROCESS_ID NUM_PROCESSES OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main() -> int:
    port, pid, nproc, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import planner
    from zoo import get_model

    assert len(jax.devices()) == 4 * nproc and len(jax.local_devices()) == 4
    b = get_model("gpt-tiny")
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step = planner.plan_parallel(b.train_step, mesh=mesh)
    plan = step.plan(b.abstract_state(), b.abstract_batch())
    doc = plan.to_dict()
    doc.pop("solver")  # timings differ between processes; everything else must not
    with open(os.path.join(out_dir, f"plan_{pid}.json"), "w") as f:
        json.dump(doc, f, sort_keys=True)

    # Same seed in every process: identical host values, placed as global arrays by the planner.
    state = jax.tree_util.tree_map(np.asarray, b.init_state(jax.random.key(0)))
    batch = jax.tree_util.tree_map(np.asarray, b.make_batch(jax.random.key(1)))
    new_state, metrics = step(state, batch)

    # Reference: the unsharded step on this process's first device, compared with the tolerances
    # derived from the summation order (tests/helpers.py), on the planned result gathered from
    # both processes.
    from jax.experimental import multihost_utils

    from tests.helpers import assert_bundle_step_close

    local = jax.local_devices()[0]
    ref_state, ref_metrics = jax.jit(b.train_step)(jax.device_put(state, local), jax.device_put(batch, local))
    got_state, got_metrics = multihost_utils.process_allgather((new_state, metrics), tiled=True)
    try:
        assert_bundle_step_close(b, state, batch, got_state, got_metrics, ref_state, ref_metrics)
        failure = None
    except AssertionError as e:
        failure = str(e)[-2000:]
    with open(os.path.join(out_dir, f"result_{pid}.json"), "w") as f:
        json.dump({"failure": failure, "loss": float(np.asarray(ref_metrics["loss"]))}, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
