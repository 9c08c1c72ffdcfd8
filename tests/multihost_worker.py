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
    # Arrays move between the processes (a pipeline's activations): DCN transfers on localhost.
    jax.config.update("jax_cross_host_transfer_socket_address", f"127.0.0.1:{int(port) + 1 + pid}")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import planner
    from zoo import get_model

    assert len(jax.devices()) == 4 * nproc and len(jax.local_devices()) == 4
    b = get_model("gpt-tiny")
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # Priced as the CPU devices it runs on (the "cpu" preset: no prefetch weighing, which on the
    # default GPU preset's inter-host link takes each 1-core process ~15 s more).
    step = planner.plan_parallel(b.train_step, mesh=mesh, hardware="cpu")
    plan = step.plan(b.abstract_state(), b.abstract_batch())
    doc = plan.to_dict()
    doc.pop("solver")  # timings differ between processes; everything else must not
    # Without a mesh the search reads the hosts from the devices' processes (planning/hosts.py).
    free = planner.plan_parallel(b.train_step, mesh_ndim=1, hardware="cpu", pipeline=False).plan(
        b.abstract_state(), b.abstract_batch())
    doc["no_mesh"] = {"mesh": list(free.mesh.shape), "inter_host_axes": list(free.options.inter_host_axes)}
    # By default, without a mesh, stages are weighed on the cluster of the two processes (on a
    # slow link between them they win); the pipeline runs: each process places its own shards of
    # the inputs, the activations move between the processes.
    from tests import mlp_pipeline
    piped = planner.plan_parallel(mlp_pipeline.step, hardware="v100", inter_host="1Gbit")
    args = mlp_pipeline.inputs()
    pplan = piped.plan(*args)
    doc["pipeline_stage_processes"] = [sorted({int(jax.devices()[i].process_index) for i in st.devices})
                                       for st in pplan.stages]
    first = piped(*args)
    _write_shards(first, out_dir, f"pipe_{pid}")
    # A second step takes the state the first handed back as it lies (each leaf on its stage).
    again = piped(first[0], first[1], *args[2:])
    doc["pipeline_second_loss_finite"] = all(bool(np.isfinite(np.asarray(sh.data)).all())
                                             for sh in again[2].addressable_shards)
    with open(os.path.join(out_dir, f"plan_{pid}.json"), "w") as f:
        json.dump(doc, f, sort_keys=True)

    # Same seed in every process: identical host values, placed as global arrays by the planner.
    state = jax.tree_util.tree_map(np.asarray, b.init_state(jax.random.key(0)))
    batch = jax.tree_util.tree_map(np.asarray, b.make_batch(jax.random.key(1)))
    new_state, metrics = step(state, batch)

    # `planner profile`'s measurement over both processes (small and quick: all-gathers of up to
    # 4 MiB): the level inside a process and the one between them, each measured alone.
    from planner.cost_model.profiling import profile
    db = profile(mesh, [4096, 65536, 1 << 20, 4 << 20], repeats=2, warmup=1, collectives=("all-gather",), compute=False)
    if pid == 0:
        db.save(os.path.join(out_dir, "profile.json"))

    # This process's shards of the result, written for the test to assemble and compare with the
    # unsharded step (no further cross-process collectives here: the fewer the coordination
    # service has in flight at shutdown, the better).
    _write_shards((new_state, metrics), out_dir, f"shards_{pid}")
    # Everything the test reads is written. The marker lets the test tell a failure of this run
    # from an abort inside XLA's coordination-service teardown that can follow it (seen once in
    # CI: "Check failed: queue.Pop() == nullptr" in grpc Server::~Server during shutdown).
    open(os.path.join(out_dir, f"done_{pid}"), "w").close()
    jax.distributed.shutdown()
    return 0


def _write_shards(tree, out_dir: str, name: str) -> None:
    """This process's shards of every leaf of `tree` (NAME.npz) and where each lies (NAME.json)."""
    arrays, index = {}, []
    for i, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        for j, shard in enumerate(leaf.addressable_shards):
            key = f"l{i}_s{j}"
            arrays[key] = np.asarray(shard.data)
            index.append([key, i, [[sl.start, sl.stop] for sl in shard.index], list(leaf.shape)])
    np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(index, f)


if __name__ == "__main__":
    sys.exit(main())
