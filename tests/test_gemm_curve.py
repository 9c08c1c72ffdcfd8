"""Achieved matmul rates: the presets' cited efficiency, a profile's measured GEMM curve, and the
analytic fallback when a profile has none (issue 11, item 1)."""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest

from planner.cost_model import CostModel, ProfileDB, get_hardware, profiled_hardware
from planner.cost_model.collectives import AxisLink
from planner.cost_model.hardware import Hardware, matmul_rate, rate_class
from planner.cost_model.model import matmul_curve
from planner.mesh import MeshSpec

MESH = MeshSpec((2, 4), ("x", "y"))
F32 = (np.dtype(np.float32),)


def _profile(samples=()) -> ProfileDB:
    db = ProfileDB.synthetic(MESH, (AxisLink(1e-5, 1 / 3e9), AxisLink(1e-5, 1 / 3e9)), sizes=(1024, 65536),
                             matmul_flops={"float32": 4e10, "bfloat16": 4e10}, memory_bandwidth=5e9)
    return dataclasses.replace(db, compute_samples=tuple(samples))


def _sample(n, rate, dtype="float32"):
    return {"kind": "matmul", "dtype": dtype, "n": n, "seconds": 2 * n**3 / rate, "flops_per_s": rate}


def test_presets_run_matmuls_at_their_cited_efficiency():
    a100 = get_hardware("a100-80gb")
    assert a100.matmul_efficiency == pytest.approx(267.9 / 312)
    cm = CostModel.default(MeshSpec((1,), ("x",)), a100)
    flops = 2.0 * 8192**3
    assert cm.compute_time(flops, 0.0, ("bfloat16",), kernels=1) == pytest.approx(flops / 267.9e12)
    # other ops' FLOPs (elementwise, reductions) still count at the peak
    assert cm.compute_time(flops, 0.0, ("bfloat16",), kernels=0) == pytest.approx(flops / 312e12)
    assert rate_class(("bfloat16",)) == "16bit" and rate_class(("bfloat16", "float32")) == "float32"
    # no published measurement: the peak, stated as an optimistic bound
    assert get_hardware("v100").matmul_efficiency == 1.0


def test_measured_curve_interpolates_in_log_flops():
    # rates measured at n = 128 and 1024 (FLOPs 2^22 and 2^31): halfway in log FLOPs is the mean rate
    db = _profile([_sample(128, 1e10), _sample(1024, 4e10), _sample(1024, 3e10)])
    curve = dict(matmul_curve(db))
    assert curve == {"float32": ((2.0 * 128**3, 1e10), (2.0 * 1024**3, 4e10))}  # best rate per size
    hw = profiled_hardware(db)
    assert hw.matmul_efficiency == 1.0  # measured rates are achieved ones
    mid = math.sqrt(2.0 * 128**3 * 2.0 * 1024**3)
    assert matmul_rate(hw, F32, mid) == pytest.approx(2.5e10)
    assert matmul_rate(hw, F32, 1.0) == pytest.approx(1e10)  # held at the end points
    assert matmul_rate(hw, F32, 1e18) == pytest.approx(4e10)
    cm = CostModel.from_profile(MESH, db, device_kind="cpu")
    assert cm.compute_time(mid, 0.0, F32, kernels=1) == pytest.approx(mid / 2.5e10)
    # no 16-bit curve measured: 16-bit matmuls use the measured peak (efficiency 1)
    assert matmul_rate(hw, ("bfloat16",), mid) == pytest.approx(4e10)


def test_profile_without_gemm_curve_falls_back_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="planner"):
        hw = profiled_hardware(_profile())
    assert hw.matmul_curve == ()
    lines = [r.getMessage() for r in caplog.records if "no GEMM curve" in r.getMessage()]
    assert len(lines) == 1 and "cpu preset" in lines[0]
    cm = CostModel.from_profile(MESH, _profile(), device_kind="cpu")
    assert cm.compute_time(8e9, 0.0, F32, kernels=1) == pytest.approx(8e9 / 4e10)


def test_bad_curves_are_rejected():
    base = get_hardware("cpu")
    with pytest.raises(ValueError, match="matmul_curve"):
        dataclasses.replace(base, matmul_curve=(("float32", ((2.0, 1.0), (1.0, 1.0))),))  # unsorted
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(base, matmul_efficiency=1.5)
    assert isinstance(dataclasses.replace(base, matmul_curve=(("16bit", ((1.0, 2.0),)),)), Hardware)
