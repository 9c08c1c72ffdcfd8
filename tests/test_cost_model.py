"""Hardware presets, cluster layout, ring/tree choice and the analytic / measured cost model."""
from __future__ import annotations

import math

import numpy as np
import pytest

from planner.cost_model import (
    DEFAULT_HARDWARE,
    PRESETS,
    AxisLink,
    Cluster,
    CostModel,
    Hardware,
    Link,
    ProfileDB,
    get_hardware,
    hardware_for_device_kind,
    ring_bytes,
)
from planner.cost_model.cluster import group_offsets, spans_hosts
from planner.cost_model.collectives import analytic_time, best_time, ring_time, tree_time
from planner.cost_model.fit import geometric_sizes
from planner.core.mesh import MeshSpec

MESH_2x4 = MeshSpec((2, 4), ("x", "y"))


def test_presets_cover_the_issue_hardware_with_positive_figures():
    for name in ("h100-sxm", "h200", "a100-40gb", "a100-80gb", "v100-16gb", "tpu-v4", "tpu-v5e", "tpu-v5p", "cpu"):
        hw = PRESETS[name]
        assert hw.flops_bf16 >= hw.flops_f32 > 0
        assert hw.intra_bandwidth > hw.inter_bandwidth > 0
        assert hw.inter_latency >= hw.intra_latency > 0
        assert hw.memory_bytes > 0 and hw.memory_bandwidth > 0
    assert get_hardware(None) is DEFAULT_HARDWARE
    assert get_hardware("H100") is PRESETS["h100-sxm"]
    assert get_hardware(PRESETS["cpu"]) is PRESETS["cpu"]
    with pytest.raises(ValueError, match="known presets"):
        get_hardware("abacus")
    with pytest.raises(ValueError, match="flops_f32"):
        Hardware("bad", 0, 1, 1, 1, 1, 1, 1, 1)


@pytest.mark.parametrize("kind, preset", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"), ("TPU v4", "tpu-v4"),
    ("TPU v5 lite", "tpu-v5e"), ("TPU v5", "tpu-v5p"), ("TPU v5p", "tpu-v5p"), ("cpu", "cpu"),
])
def test_device_kind_names_its_preset(kind, preset):
    assert hardware_for_device_kind(kind).name == preset


def test_unknown_device_kind_has_no_preset():
    assert hardware_for_device_kind("Quantum Abacus 9000") is None


def test_ring_bytes_and_tree_choice_by_size():
    assert ring_bytes("all-reduce", 800, 8) == pytest.approx(1400)
    assert ring_bytes("all-gather", 800, 8) == pytest.approx(700)
    assert ring_bytes("collective-permute", 800, 8) == 800
    with pytest.raises(ValueError, match="unknown collective"):
        ring_bytes("all-sum", 1, 2)
    link = AxisLink(10e-6, 1e-9)
    small, large = 1024, 64 * 2**20
    assert best_time("all-reduce", small, 8, link)[1] == "tree"
    assert best_time("all-reduce", large, 8, link)[1] == "ring"
    assert best_time("all-reduce", small, 8, link)[0] == pytest.approx(tree_time("all-reduce", small, 8, link))
    assert tree_time("all-gather", small, 8, link) == math.inf
    # the analytic time never exceeds the ring time
    for n in (2, 4, 8, 16):
        for b in (1e3, 1e5, 1e7):
            assert best_time("all-reduce", b, n, link)[0] <= ring_time("all-reduce", b, n, link)


def test_cluster_inter_host_axes_of_row_major_layouts():
    cluster = Cluster(2, 4)
    assert cluster.inter_host_axes(MeshSpec((2, 4), ("x", "y"))) == (0,)
    assert cluster.inter_host_axes(MeshSpec((4, 2), ("x", "y"))) == (0,)  # stride 2: groups {0,2,4,6}
    assert cluster.inter_host_axes(MeshSpec((8,), ("x",))) == (0,)
    assert cluster.inter_host_axes(MeshSpec((2, 2, 2), ("x", "y", "z"))) == (0,)
    assert Cluster(4, 2).inter_host_axes(MeshSpec((2, 4), ("x", "y"))) == (0, 1)
    assert Cluster(1, 8).inter_host_axes(MeshSpec((2, 4), ("x", "y"))) == ()
    with pytest.raises(ValueError, match="16 devices"):
        Cluster(2, 4).inter_host_axes(MeshSpec((4, 4), ("x", "y")))
    assert spans_hosts(MeshSpec((2, 2, 2), ("x", "y", "z")), (1, 2), Cluster(2, 4).host_of()) is False
    assert group_offsets(MESH_2x4, (0,)) == (0, 4)
    assert group_offsets(MESH_2x4, (0, 1)) == tuple(range(8))


def test_cluster_links_and_parse():
    c = Cluster.parse("2x4:h100")
    assert (c.hosts, c.devices_per_host, c.hardware.name) == (2, 4, "h100-sxm")
    links = CostModel.for_cluster(MESH_2x4, c).links
    assert links[0] == AxisLink(c.hardware.inter_latency, 1 / c.hardware.inter_bandwidth)
    assert links[1] == AxisLink(c.hardware.intra_latency, 1 / c.hardware.intra_bandwidth)
    custom = Cluster(2, 4, inter=Link(1e9, 1e-4))
    assert custom.axis_links(MESH_2x4)[0] == AxisLink(1e-4, 1e-9)
    with pytest.raises(ValueError, match="HOSTSxDEVICES"):
        Cluster.parse("lots")


def test_default_model_matches_inter_host_axes():
    hw = get_hardware("a100-80gb")
    cm = CostModel.default(MESH_2x4, hw, inter_host_axes=(0,))
    nbytes = 2**26
    t0 = cm.collective_time("all-reduce", nbytes, (0,))
    t1 = cm.collective_time("all-reduce", nbytes, (1,))
    assert t0 == pytest.approx(2 * hw.inter_latency + ring_bytes("all-reduce", nbytes, 2) / hw.inter_bandwidth)
    assert t0 > t1
    # combined reductions pay no latency; single-device groups and empty buffers cost nothing
    assert cm.collective_time("all-reduce", nbytes, (1,), combined=True) < t1
    assert cm.collective_time("all-gather", 0, (0,)) == 0.0
    assert CostModel.default(MeshSpec((1, 8), ("x", "y"))).collective_time("all-reduce", 1e6, (0,)) == 0.0
    # groups run at their slowest axis
    assert cm.collective_time("all-gather", nbytes, (0, 1)) == pytest.approx(
        analytic_time("all-gather", nbytes, (0, 1), MESH_2x4, (cm.links[0], cm.links[0])))


def test_compute_time_is_a_roofline():
    cm = CostModel.default(MESH_2x4, get_hardware("h100"))
    hw = cm.hardware
    assert cm.compute_time(1e12, 0, np.float32) == pytest.approx(1e12 / hw.flops_f32)
    assert cm.compute_time(1e12, 0, np.dtype("bfloat16") if hasattr(np, "bfloat16") else np.float16) == \
        pytest.approx(1e12 / hw.flops_bf16)
    assert cm.compute_time(1, 1e9, np.float32) == pytest.approx(1e9 / hw.achieved_bandwidth)  # the measured share


def test_measured_model_uses_profile_curves_and_derives_links():
    fast, slow = AxisLink(5e-6, 1e-11), AxisLink(50e-6, 1e-10)
    db = ProfileDB.synthetic(MESH_2x4, (slow, fast), sizes=geometric_sizes(1024, 2**28),
                             matmul_flops={"float32": 1e10}, memory_bandwidth=1e9)
    cm = CostModel.from_profile(MESH_2x4, db, device_kind="cpu")
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        for axes in ((0,), (1,), (0, 1)):
            for nbytes in (100, 1024, 3000, 2**20, 2**30):  # sampled, between samples, beyond the range
                expect = analytic_time(kind, nbytes, axes, MESH_2x4, (slow, fast))
                assert cm.algorithm(kind, nbytes, axes) == "measured"
                assert cm.collective_time(kind, nbytes, axes) == pytest.approx(expect, rel=0.02), (kind, axes, nbytes)
    assert cm.collective_time("all-reduce", 2**20, (1, 0)) == cm.collective_time("all-reduce", 2**20, (0, 1))
    combined = cm.collective_time("all-reduce", 2**20, (0,), combined=True)
    assert combined < cm.collective_time("all-reduce", 2**20, (0,))
    # measured compute figures replace the preset's peaks
    assert cm.hardware.flops_f32 == 1e10 and cm.hardware.memory_bandwidth == 1e9
    # per-axis links derived from the all-reduce fits reproduce the synthetic links
    assert cm.links[0].beta == pytest.approx(slow.beta, rel=0.02)
    assert cm.links[1].beta == pytest.approx(fast.beta, rel=0.02)


def test_cluster_description_as_hardware_option():
    from planner.core.errors import MeshError
    from planner.core.options import PlanOptions
    from planner.search.mesh_plan import cost_model_for

    assert get_hardware("2x4:h100").name == "h100-sxm"
    options = PlanOptions.from_kwargs({"hardware": "2x4:h100"})
    cm = cost_model_for(MESH_2x4, options)
    assert cm.hardware.name == "h100-sxm"
    assert cm.links[0] == AxisLink(cm.hardware.inter_latency, 1 / cm.hardware.inter_bandwidth)
    assert cm.links[1] == AxisLink(cm.hardware.intra_latency, 1 / cm.hardware.intra_bandwidth)
    assert options.to_json()["hardware"] == "2x4:h100"
    with pytest.raises(MeshError, match="16 devices"):
        cost_model_for(MESH_2x4, PlanOptions.from_kwargs({"hardware": "2x8:h100"}))
