"""Hardware presets price work at achieved rates, each with its source: no preset runs a matmul or
streams memory at its datasheet peak, GPU presets carry a kernel launch floor, and a printed plan
says where its rates come from."""
from __future__ import annotations

import contextlib
import io
import re

import jax.numpy as jnp
import numpy as np
import pytest

from planner.cost_model.collectives import AxisLink
from planner.cost_model.hardware import PRESETS, matmul_rate, peak_flops
from planner.cost_model.model import CostModel, profiled_hardware
from planner.cost_model.profile_db import ProfileDB
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.graph.trace import trace
from planner.search.mesh_plan import make_plan

SOURCE = re.compile(r"measured|stand-in|Bekman|profile", re.IGNORECASE)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_an_achieved_curve_below_its_peak(name):
    hw = PRESETS[name]
    assert SOURCE.search(hw.rates_source), f"{name}: rates_source {hw.rates_source!r} names no source"
    if hw.platform != "cpu":  # the CPU's figures are this machine's measured rates
        assert hw.memory_efficiency < 1.0
    assert hw.matmul_efficiency < 1.0  # contractions without a curve of their class run at this plateau
    for cls, points in hw.matmul_curve:
        peak = peak_flops(hw, ("bfloat16",) if cls == "16bit" else ("float32",))
        assert all(0 < r < peak for _, r in points), (name, cls)
    for dtype in ("bfloat16", "float32"):
        peak = peak_flops(hw, (dtype,))
        for flops in np.logspace(3, 16, 27):  # a kFLOP to 10 PFLOP per kernel, and outside the sweep
            assert 0 < matmul_rate(hw, (dtype,), float(flops)) < peak, (name, dtype, flops)


def test_memory_bound_work_runs_at_the_achieved_bandwidth():
    hw = PRESETS["h100-sxm"]
    model = CostModel.default(MeshSpec((8,), ("x",)), hw)
    t = model.compute_time(0.0, 1e9)
    assert t == pytest.approx(1e9 / (hw.memory_bandwidth * hw.memory_efficiency))
    assert t > 1e9 / hw.memory_bandwidth


def test_stand_in_curves_are_the_measured_curve_scaled_by_the_peak_ratio():
    """Where nothing is published the curve is the H100's sweep with its kernel times kept: rates and
    sizes scaled by the datasheet peak ratio, so every point is the H100's fraction of peak at a
    proportionally smaller GEMM."""
    h100_hw = PRESETS["h100-sxm"]
    h100 = dict(h100_hw.matmul_curve)["16bit"]
    for name in ("v100-16gb", "tpu-v4", "tpu-v5e", "tpu-v5p"):
        hw = PRESETS[name]
        ratio = hw.flops_bf16 / h100_hw.flops_bf16
        curve = dict(hw.matmul_curve)["16bit"]
        np.testing.assert_allclose([f for f, _ in curve], [f * ratio for f, _ in h100], rtol=1e-12)
        np.testing.assert_allclose([r for _, r in curve], [r * ratio for _, r in h100], rtol=1e-12)
        np.testing.assert_allclose([f / r for f, r in curve], [f / r for f, r in h100], rtol=1e-12)  # same times
    # the A100's measured plateau at every size (no sweep published; the launch floor below it)
    a100 = PRESETS["a100-80gb"]
    assert not a100.matmul_curve and a100.matmul_efficiency == pytest.approx(267.9 / 312)


def test_a_profile_replaces_the_presets_rates_and_says_so():
    db = ProfileDB.synthetic((1,), [AxisLink(1e-5, 1e-10)], device_kind="NVIDIA H100 80GB HBM3", platform="gpu",
                             collectives=(), matmul_flops={"bfloat16": 7e14}, memory_bandwidth=3e12)
    hw = profiled_hardware(db)
    assert hw.memory_efficiency == 1.0 and hw.achieved_bandwidth == 3e12
    assert "planner profile" in hw.rates_source and "memory bandwidth" in hw.rates_source


def test_the_printed_plan_names_where_its_rates_come_from(tmp_path):
    from planner.cli.commands import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", "--model", "mlp-tiny", "--devices", "8", "--hardware", "tpu-v5p"])
    assert code == 0
    text = out.getvalue()
    line = next(l for l in text.splitlines() if l.strip().startswith("achieved rates"))
    assert "stand-in" in line


def test_gpu_presets_carry_a_launch_floor_and_tiny_dots_pay_it():
    for name in ("h100-sxm", "a100-80gb", "v100-16gb"):
        assert 1e-6 <= PRESETS[name].kernel_launch_s <= 1e-5
    graph = trace(lambda a, b: a @ b, jnp.ones((8, 8)), jnp.ones((8, 8)))
    plan = make_plan(graph, MeshSpec((1,), ("x",)), PlanOptions(hardware="h100"))
    tie_break = sum(1e-13 * graph.tensors[t].nbytes for t in graph.inputs)
    assert plan.prediction.compute_time_s == pytest.approx(PRESETS["h100-sxm"].kernel_launch_s + tie_break)

