"""Multi-host for real: 2 processes x 4 CPU devices on localhost (jax.distributed, gloo)."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

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
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    plans = [json.loads((tmp_path / f"plan_{i}.json").read_text()) for i in range(2)]
    assert plans[0] == plans[1]
    for i in range(2):
        result = json.loads((tmp_path / f"result_{i}.json").read_text())
        assert result["failure"] is None, result["failure"]
