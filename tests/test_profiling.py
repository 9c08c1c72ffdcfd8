"""`planner profile` (planner.cost_model.profiling): flags, an in-process run, and a real 2-process run."""
from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cost_model.model import attention_curve, matmul_curve
from planner.cost_model import COLLECTIVES, CostModel, ProfileDB
from planner.cost_model import profiling
from planner.core.mesh import MeshSpec
from tests.conftest import skip_if_fewer_devices

ROOT = Path(__file__).resolve().parents[1]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profiling.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_and_defaults():
    args = _parse("--out", "p.json")
    assert (args.max_bytes, args.min_bytes, args.mesh, args.quiet) == (256 * 2**20, 1024, None, False)
    args = _parse("--out", "p.json", "--max-bytes", "64MiB", "--min-bytes", "2KiB", "--repeats", "3", "--mesh", "2x4",
                  "--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1", "--quiet")
    assert (args.max_bytes, args.min_bytes, args.repeats, args.mesh) == (64 * 2**20, 2048, 3, "2x4")
    assert (args.coordinator, args.num_processes, args.process_id, args.quiet) == ("10.0.0.1:1234", 2, 1, True)
    with pytest.raises(SystemExit):
        _parse("--out", "p.json", "--max-bytes", "lots")
    with pytest.raises(SystemExit):
        _parse("--max-bytes", "1MiB")  # --out is required


@pytest.fixture
def single_process(monkeypatch):
    """No cluster environment variables: the in-process runs must not start jax.distributed."""
    for name in (*profiling._CLUSTER_ENV, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def test_bad_options_exit_with_a_message(tmp_path, capsys, single_process):
    out = str(tmp_path / "p.json")
    assert profiling.main(["--out", out, "--min-bytes", "1MiB", "--max-bytes", "1KiB"]) == 2
    assert "--min-bytes" in capsys.readouterr().err
    assert profiling.main(["--out", out, "--collectives", "all-sum"]) == 2
    assert profiling.main(["--out", str(tmp_path / "nowhere" / "p.json")]) == 2
    assert profiling.main(["--out", out, "--mesh", "3x3", "--max-bytes", "1KiB"]) == 2
    assert not os.path.exists(out)


def test_progress_bar_writes_lines():
    stream = io.StringIO()
    bar = profiling.ProgressBar(20, stream)
    for _ in range(20):
        bar.step("x")
    lines = stream.getvalue().splitlines()
    assert 2 <= len(lines) <= 12 and lines[-1].startswith("[" + "#" * 30 + "] 20/20")


def test_in_process_run_writes_a_usable_database(tmp_path, single_process):
    skip_if_fewer_devices(8)
    out = tmp_path / "p.json"
    rc = profiling.main(["--out", str(out), "--mesh", "2x4", "--max-bytes", "4KiB", "--repeats", "2", "--warmup", "1",
                         "--collectives", "all-reduce,all-gather", "--quiet"])
    assert rc == 0
    db = ProfileDB.load(out)
    assert db.num_devices == 8 and db.device_kind == "cpu" and db.mesh.shape == (2, 4)
    assert {(e.collective, e.axes) for e in db.collectives} == {
        (k, a) for k in ("all-reduce", "all-gather") for a in ((0,), (1,), (0, 1))}
    assert all(len(e.nbytes) == 2 and all(len(r) == 2 for r in e.seconds) for e in db.collectives)
    assert dict(db.matmul_flops).keys() == {"float32", "bfloat16"} and db.memory_bandwidth > 0
    assert dict(matmul_curve(db)).keys() == {"float32", "16bit"}  # the swept GEMMs: a measured curve
    # attention's batched matmuls, per dtype class and head dimension (64 and 128)
    assert {(cls, d) for cls, d, _ in attention_curve(db)} == {(c, d) for c in ("float32", "16bit") for d in (64, 128)}
    assert "attention 16bit    d=64" in profiling.summary(db)
    # XLA:CPU compiles no copies to its pinned host memory (its fusions read the host buffers in
    # place), so there is no host link to measure: none recorded, and plans keep the preset's figure
    assert db.host_bandwidth is None and "host link" not in profiling.summary(db)
    cm = CostModel.from_profile(MeshSpec((2, 4), ("x", "y")), out)
    assert cm.algorithm("all-reduce", 2048, (1,)) == "measured"
    assert cm.collective_time("all-reduce", 2048, (1,)) > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost(tmp_path):
    """2 processes x 4 CPU devices, gloo collectives, for real; only process 0 writes."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "planner.cost_model.profiling", "--out", str(outs[i]), "--max-bytes", "16KiB",
             "--repeats", "2", "--warmup", "1", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert not outs[1].exists()  # only process 0 writes
    assert "wrote" in results[0][0] and "[" in results[0][1]  # summary on stdout, progress bar on stderr
    db = ProfileDB.load(outs[0])
    assert (db.num_devices, db.num_processes, db.mesh.shape) == (8, 2, (2, 4))
    assert db.host_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert {(e.collective, e.axes) for e in db.collectives} == {
        (k, a) for k in COLLECTIVES for a in ((0,), (1,), (0, 1))}
    assert all(e.fit.alpha >= 0 and e.fit.beta >= 0 for e in db.collectives)
    assert json.loads(outs[0].read_text())["jax_version"]
    mesh = MeshSpec((2, 4), ("x", "y"))
    cm = CostModel.from_profile(mesh, db)
    assert cm.measured.inter_host_axes == (0,)
    assert all(cm.algorithm(k, 8192, a) == "measured" for k in COLLECTIVES for a in ((0,), (1,), (0, 1)))
