"""The planner follows the profile: the profiled devices name the plan, its budget and its rates;
data parallelism on the slow mesh axis, tensor parallelism on the fast one."""
from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import planner
from planner import cli
from planner.cost_model import PRESETS, AxisLink, CostModel, ProfileDB, profiled_hardware
from planner.core.errors import ProfileError
from planner.core.mesh import MeshSpec
from zoo import get_model
from tests.conftest import skip_if_fewer_devices

# Per-link figures of the synthetic profile: the slow axis is 10x slower in latency and bandwidth,
# like a cross-host axis next to an NVLink one.
FAST = AxisLink(5e-6, 1 / 100e9)
SLOW = AxisLink(50e-6, 1 / 10e9)


def _axes(spec) -> set[int]:
    return {a for dim in spec for a in dim}


@pytest.mark.parametrize("slow", [0, 1])
def test_data_parallel_on_the_slow_axis_tensor_parallel_on_the_fast_one(slow, tmp_path):
    """Weights (12 d^2 per layer) outweigh activations (batch x seq x d), so the fast axis should
    split the weights (Megatron tensor parallelism) and the slow axis the batch."""
    skip_if_fewer_devices(8)
    fast = 1 - slow
    links = (SLOW, FAST) if slow == 0 else (FAST, SLOW)
    db = ProfileDB.synthetic((2, 4), links)
    profile = db
    if slow == 1:  # also exercise the file path
        profile = str(tmp_path / "profile.json")
        db.save(profile)
    bundle = get_model("gpt-tiny", layers=1, d_model=256)
    state, batch = bundle.abstract_state(), bundle.abstract_batch()
    step = planner.plan_parallel(bundle.train_step, mesh="2x4", profile=profile)
    plan, graph = step.plan(state, batch), step.graph(state, batch)

    # data parallelism: the forward activations and the targets are split by batch on the slow axis only
    op_specs = {(i, k): spec for i, k, spec in plan.op_specs}
    fc_in = [op for op in graph.ops if op.primitive.name == "dot_general"
             and op.name_stack.endswith("blocks_0/mlp/fc_in") and "transpose" not in op.name_stack]
    assert len(fc_in) == 1
    hidden = op_specs[(fc_in[0].index, 0)]  # (batch, seq, 4 d_model)
    assert hidden[0] == (slow,), hidden
    assert plan.spec_of("[1]['targets']")[0] == (slow,)
    # tensor parallelism: the MLP hidden dim and every weight matrix are split on the fast axis
    assert hidden[2] == (fast,), hidden
    kernels = [(p, s) for p, s in zip(plan.input_paths, plan.input_specs)
               if p.startswith("[0]['params']['blocks_") and p.endswith("['kernel']")]
    assert len(kernels) == 6
    for path, spec in kernels:
        assert fast in _axes(spec), (path, spec)


def test_plan_with_a_corrupt_profile_is_a_profile_error(tmp_path):
    skip_if_fewer_devices(8)
    path = tmp_path / "profile.json"
    path.write_text('{"format": "planner-profile", "version": 1')
    with pytest.raises(ProfileError, match=f"{path}.*not valid JSON"):
        planner.plan(lambda x: x * 2.0, jnp.ones((8, 8)), mesh="2x4", profile=str(path))


# --- the profiled devices name the plan, its budget and its MFU ------------------------------------

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))


def _profile(**kw) -> ProfileDB:
    db = ProfileDB.synthetic(MESH_2x4, (AxisLink(10e-6, 1 / 3e9), AxisLink(10e-6, 1 / 3e9)), device_kind="cpu",
                             sizes=(1024, 65536), matmul_flops={"float32": 3e10, "bfloat16": 3e10},
                             memory_bandwidth=5e9)
    return dataclasses.replace(db, **kw)


def test_profiled_hardware_comes_from_the_profile():
    hw = profiled_hardware(_profile(kernel_launch_s=7e-6, device_memory_bytes=2e9))
    assert hw.name == "cpu" and hw.flops_f32 == 3e10 and hw.memory_bandwidth == 5e9
    assert hw.memory_bytes == 2e9 and hw.kernel_launch_s == 7e-6
    cm = CostModel.from_profile(MESH_2x4, _profile(kernel_launch_s=7e-6), device_kind="cpu")
    assert cm.hardware.kernel_launch_s == 7e-6  # the measured launch floor is read and used
    assert cm.compute_time(1.0, 1.0, (np.dtype(np.float32),), kernels=1) == 7e-6
    # without a measured figure: the preset of the device kind; no preset: its kind as the name
    assert profiled_hardware(_profile()).memory_bytes == PRESETS["cpu"].memory_bytes
    assert profiled_hardware(_profile(device_kind="Imaginary X1")).name == "imaginary x1"
    # the host link: measured where the profile has it (GPU), else the preset's figure
    assert profiled_hardware(_profile(host_bandwidth=4e10)).host_bandwidth == 4e10
    assert profiled_hardware(_profile()).host_bandwidth == PRESETS["cpu"].host_bandwidth


def test_cli_plans_for_the_profiled_devices(tmp_path, capsys):
    path = tmp_path / "prof.json"
    _profile(device_memory_bytes=2e9).save(path)
    out_json = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "2x4", "--profile", str(path), "--quiet",
                     "--time-limit", "10", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(cpu)" in out and "a100" not in out
    assert "of 2.00 GB budget" in out
    data = json.loads(out_json.read_text())
    assert data["context"]["hardware"]["name"] == "cpu" and data["context"]["hardware"]["flops_f32"] == 3e10



def test_cli_warns_in_one_line_where_the_profile_measured_another_mesh(tmp_path, capsys):
    """Planning 4x2 with a 2x4 profile warns (ProfileWarning) as one `planner: warning:` line,
    without the Python source line that raised it."""
    path = tmp_path / "prof.json"
    _profile(device_memory_bytes=2e9).save(path)
    code = cli.main(["plan", "--model", "mlp-tiny", "--mesh", "4x2", "--profile", str(path), "--quiet",
                     "--time-limit", "10"])
    err = capsys.readouterr().err
    assert code == 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("planner: warning: profile ") for line in lines), err
    assert "measured on mesh 2x4, not 4x2" in lines[0]
