"""Multi-host for real: 2 processes x 4 CPU devices on localhost (jax.distributed, gloo)."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

from tests.helpers import assert_bundle_step_close
from zoo import get_model

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_plan_identically_and_match_one_process(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), "2", str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host workers timed out")
        outputs.append(out)
    for i, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            # A worker that wrote everything and then died in `jax.distributed.shutdown` hit the
            # teardown abort of XLA's coordination service, not a planner failure: its results are
            # checked below all the same. Anything else fails the test.
            assert (tmp_path / f"done_{i}").exists() and "Shutdown" in out, out[-3000:]
            warnings.warn(f"multi-host worker {i} aborted in jax.distributed.shutdown after finishing "
                          f"(exit {p.returncode}); its results are complete and checked")
    plans = [json.loads((tmp_path / f"plan_{i}.json").read_text()) for i in range(2)]
    assert plans[0] == plans[1]
    # Each process is a host: the given mesh's axis across the processes ("x") is priced on the
    # inter-host link, and so is the one axis of the 8-device mesh the search plans without a mesh.
    assert plans[0]["options"]["inter_host_axes"] == [0]
    assert plans[0]["no_mesh"] == {"mesh": [8], "inter_host_axes": [0]}, plans[0]["no_mesh"]
    _pipeline_across_processes(tmp_path, plans[0]["pipeline_stage_processes"])
    assert plans[0]["pipeline_second_loss_finite"] and plans[1]["pipeline_second_loss_finite"]
    # Assemble the planned result from both processes' shards and compare it with the unsharded
    # step here, at the tolerances derived from the summation order (tests/helpers.py).
    b = get_model("gpt-tiny")
    state = jax.tree_util.tree_map(np.asarray, b.init_state(jax.random.key(0)))
    batch = jax.tree_util.tree_map(np.asarray, b.make_batch(jax.random.key(1)))
    ref_state, ref_metrics = jax.jit(b.train_step)(state, batch)
    new_state, metrics = _assembled(tmp_path, "shards", (ref_state, ref_metrics))
    assert_bundle_step_close(b, state, batch, new_state, metrics, ref_state, ref_metrics)
    _profile_measured_each_level(tmp_path / "profile.json")


def _assembled(tmp_path: pathlib.Path, name: str, like):
    """The tree like `like` assembled from both processes' shards (NAME_<pid>.npz / .json)."""
    leaves, tree = jax.tree_util.tree_flatten(like)
    got = [np.full(np.shape(x), np.nan, dtype=np.asarray(x).dtype) if np.issubdtype(np.asarray(x).dtype, np.floating)
           else np.zeros(np.shape(x), np.asarray(x).dtype) for x in leaves]
    covered = [np.zeros(np.shape(x), bool) for x in leaves]
    for pid in range(2):
        data = np.load(tmp_path / f"{name}_{pid}.npz")
        for key, i, slices, shape in json.loads((tmp_path / f"{name}_{pid}.json").read_text()):
            assert list(np.shape(leaves[i])) == shape
            where = tuple(slice(lo, hi) for lo, hi in slices)
            got[i][where] = data[key]
            covered[i][where] = True
    assert all(c.all() for c in covered), f"the two processes' shards do not cover every result ({name})"
    return jax.tree_util.tree_unflatten(tree, got)


def _pipeline_across_processes(tmp_path: pathlib.Path, stage_processes) -> None:
    """The pipeline the two processes ran (tests/mlp_pipeline.py: planned with stages on the
    cluster of the two processes, each stage on one process's devices, activations moving between
    them): its first step as the unsharded step's, within the bounds of the summation order."""
    from tests import mlp_pipeline
    from tests.helpers import assert_first_step_close

    assert len(stage_processes) >= 2 and {p for ps in stage_processes for p in ps} == {0, 1}, stage_processes
    params, opt_state, x, y = mlp_pipeline.inputs()
    ref_params, ref_opt, ref_l = jax.jit(mlp_pipeline.step)(params, opt_state, x, y)
    new_params, new_opt, l = _assembled(tmp_path, "pipe", (ref_params, ref_opt, ref_l))
    assert_first_step_close(lambda p, b: mlp_pipeline.loss(p, *b), mlp_pipeline.OPT,
                            {"params": params, "opt_state": opt_state}, (x, y),
                            {"params": new_params, "opt_state": new_opt}, {"loss": l},
                            {"params": ref_params, "opt_state": ref_opt}, {"loss": ref_l},
                            train_step=lambda s, b: mlp_pipeline.step(s["params"], s["opt_state"], *b))


def _profile_measured_each_level(path: pathlib.Path) -> None:
    """The profile the two processes measured: its two levels (inside a process, between them) each
    read from the groups that cross it, and those links price a topology of another shape."""
    from planner.core.mesh import MeshSpec
    from planner.cost_model import CostModel, get_hardware
    from planner.cost_model.profile_db import ProfileDB
    from planner.cost_model.profile_levels import measured_levels
    from planner.cost_model.profiling import summary
    from planner.cost_model.topology import Link, Topology, Level, levels_text

    db = ProfileDB.load(path)
    assert db.num_processes == 2 and db.host_of == (0,) * 4 + (1,) * 4 and db.topology is None
    levels = measured_levels(db)
    assert sorted(levels) == [0, 1] and all(link.bandwidth > 0 for link in levels.values())
    text = summary(db)
    assert "level host" in text and "level network" in text
    cpu = get_hardware("cpu")
    target = Topology((Level("host", 4, Link(1e9, 1e-6)), Level("network", 4, Link(1e8, 1e-5))), 4)
    cm = CostModel.build(MeshSpec((4, 4), ("x", "y")), levels_text(target, cpu), profile=db)
    assert 1 / cm.links[0].beta == levels[1].bandwidth and 1 / cm.links[1].beta == levels[0].bandwidth
