"""Achieved matmul rates: the presets' cited efficiency, a profile's measured GEMM curve, and the
analytic fallback when a profile has none."""
from __future__ import annotations

import dataclasses
import logging
import math

import jax.numpy as jnp
import numpy as np
import pytest

from planner.cost_model import CostModel, ProfileDB, get_hardware, profiled_hardware
from planner.cost_model.collectives import AxisLink
from planner.cost_model.hardware import Hardware, matmul_rate, rate_class
from planner.cost_model.model import matmul_curve
from planner.graph.trace import trace
from planner.ilp.rules import signature
from planner.ilp.strategies import enumerate_strategies
from planner.core.mesh import MeshSpec

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
    # 16-bit GEMMs at the A100's measured plateau (no size sweep is published for it)
    assert cm.compute_time(flops, 0.0, ("bfloat16",), kernels=1) == pytest.approx(flops / 267.9e12)
    # float32 GEMMs at the cited plateau (no float32 curve)
    assert cm.compute_time(flops, 0.0, ("float32",), kernels=1) == pytest.approx(flops / (19.5e12 * 267.9 / 312))
    # other ops' FLOPs (elementwise, reductions) still count at the peak
    assert cm.compute_time(flops, 0.0, ("bfloat16",), kernels=0) == pytest.approx(flops / 312e12)
    assert rate_class(("bfloat16",)) == "16bit" and rate_class(("bfloat16", "float32")) == "float32"
    # no published measurement: a stand-in below the peak, labelled as such
    v100 = get_hardware("v100")
    assert v100.matmul_efficiency < 1.0 and "stand-in" in v100.rates_source


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


# --- attention shapes: batched narrow GEMMs -----------------------------------------------------


def _attention_sample(d, seq, g, rate, dtype="bfloat16"):
    return {"kind": "attention", "dtype": dtype, "batch": g, "seq": seq, "head_dim": d,
            "seconds": 4.0 * g * seq * seq * d / rate, "flops_per_s": rate}


def test_attention_curve_is_read_per_head_dimension():
    db = _profile([_sample(1024, 4e10, "bfloat16"), _attention_sample(64, 128, 8, 1e9),
                   _attention_sample(64, 1024, 8, 5e9), _attention_sample(128, 128, 8, 2e9),
                   _attention_sample(64, 1024, 8, 4e9)])
    hw = profiled_hardware(db)
    f64, f1024 = 2.0 * 8 * 128**2 * 64, 2.0 * 8 * 1024**2 * 64
    assert hw.attention_curve == (("16bit", 64, ((f64, 1e9), (f1024, 5e9))),  # best rate per point
                                  ("16bit", 128, ((2.0 * 8 * 128**2 * 128, 2e9),)))
    bf16 = ("bfloat16",)
    assert matmul_rate(hw, bf16, math.sqrt(f64 * f1024), narrow=64) == pytest.approx(3e9)  # log-FLOPs midpoint
    assert matmul_rate(hw, bf16, f64, narrow=48) == pytest.approx(1e9)  # nearest d in log scale: 64
    assert matmul_rate(hw, bf16, f64, narrow=100) == pytest.approx(2e9)  # 128
    assert matmul_rate(hw, bf16, f64, narrow=256) == pytest.approx(2e9)
    # not narrow, not batched, or no curve for the dtype class: the square GEMM curve or the peak
    assert matmul_rate(hw, bf16, f64, narrow=512) == matmul_rate(hw, bf16, f64) == pytest.approx(4e10)
    assert matmul_rate(hw, F32, f64, narrow=64) == pytest.approx(4e10)


def test_profile_without_attention_curve_keeps_the_square_curve(caplog):
    with caplog.at_level(logging.INFO, logger="planner"):
        hw = profiled_hardware(_profile([_sample(128, 1e10), _sample(1024, 4e10)]))
    assert hw.attention_curve == ()
    assert sum("no attention-shape curve" in r.getMessage() for r in caplog.records) == 1
    assert matmul_rate(hw, F32, 2.0 * 128**3, narrow=64) == pytest.approx(1e10)
    with pytest.raises(ValueError, match="attention_curve"):
        dataclasses.replace(hw, attention_curve=(("16bit", 0, ((1.0, 1.0),)),))
    with pytest.raises(ValueError, match="attention_curve"):
        dataclasses.replace(hw, attention_curve=(("8bit", 64, ((1.0, 1.0),)),))


def _dot_strategies(fn, shapes, hw, mesh):
    g = trace(fn, *(jnp.ones(s, jnp.bfloat16) for s in shapes))
    op = next(o for o in g.ops if o.name == "dot_general")
    sig = signature(op, g)
    strategies = enumerate_strategies(sig, [g.tensors[x] for x in op.inputs], [g.tensors[op.outputs[0]]],
                                      CostModel.default(mesh, hw))
    return sig, strategies


def _scores(q, k):
    return jnp.einsum("gsd,gtd->gst", q, k)


def test_attention_shaped_dots_run_at_the_attention_curve_per_device_share():
    """Scores q k^T of 4 slices x 128 tokens x head dimension 64: the narrowest side is d = 64, or
    its 32-element share when d (contracted) is split over 2 devices; a batch split keeps 64."""
    hw = dataclasses.replace(get_hardware("h100"), memory_bandwidth=1e30, kernel_launch_s=0.0,
                             matmul_curve=(("16bit", ((1.0, 7e12),)),),
                             attention_curve=(("16bit", 32, ((1.0, 1e12),)), ("16bit", 64, ((1.0, 2e12),))))
    sig, (only,) = _dot_strategies(_scores, [(4, 128, 64)] * 2, hw, MeshSpec((1,), ("x",)))
    assert only.compute_time == pytest.approx(sig.flops / 2e12)
    sig, strategies = _dot_strategies(_scores, [(4, 128, 64)] * 2, hw, MeshSpec((2,), ("x",)))
    (contracted,) = sig.sum_labels
    (batch,) = set(sig.inputs[0]) & set(sig.inputs[1]) & set(sig.outputs[0])
    split = {l: [s for s in strategies if dict(s.assignment).get(l)] for l in (contracted, batch)}
    assert split[contracted] and all(s.compute_time == pytest.approx(sig.flops / 2 / 1e12) for s in split[contracted])
    assert split[batch] and all(s.compute_time == pytest.approx(sig.flops / 2 / 2e12) for s in split[batch])
    # unbatched, or batched with every side wider than NARROW_GEMM_DIM: the square curve
    sig, (only,) = _dot_strategies(lambda a, b: a @ b, [(64, 512), (512, 64)], hw, MeshSpec((1,), ("x",)))
    assert only.compute_time == pytest.approx(sig.flops / 7e12)
    sig, (only,) = _dot_strategies(_scores, [(2, 512, 512)] * 2, hw, MeshSpec((1,), ("x",)))
    assert only.compute_time == pytest.approx(sig.flops / 7e12)
