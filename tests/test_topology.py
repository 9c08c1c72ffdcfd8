"""Clusters as they are built: TPU slices (tori with wraparound), multislice over DCN, NVLink domains
wider than a host; each mesh axis priced by the links it spans, the emitted mesh ordered as priced."""
from __future__ import annotations

import json
import math
import types

import jax
import numpy as np
import pytest

from planner import cli
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.cost_model import Cluster, CostModel, get_hardware
from planner.cost_model.collectives import ring_time, AxisLink
from planner.cost_model.topology import device_order, from_devices, parse_topology
from planner.search.mesh_plan import cost_model_for

V5P_PORT = 100e9  # Cloud TPU v5p: 1,200 GB/s bidirectional ICI per chip over 6 ports
V5P_ICI_LAT = get_hardware("v5p").intra_latency


def _mesh(*shape):
    return MeshSpec(tuple(shape), tuple("xyzw"[:len(shape)]))


def _gbps(link: AxisLink) -> float:
    return 1.0 / link.beta / 1e9


@pytest.mark.parametrize("text, shape, axis_gbps, group_gbps", [
    # a full cube wraps around: an axis on one whole dimension rings both ways (2 ports), on two 4
    ("v5p:4x4x4", (4, 16), [200, 400], 600),
    ("v5p:4x4x4", (4, 4, 4), [200, 200, 200], 600),
    # axis 0 takes every other chip of a wrapped dimension: two interleaved rings share its links
    # (2 ports / 2); axis 1 covers two wrapped dimensions and half of the third (2 + 2 + 1 ports)
    ("v5p:4x4x4", (2, 32), [100, 500], 600),
    # no wraparound below a cube: each dimension a line, one port's worth
    ("v5p:2x2x2", (8,), [300], None),
    ("v5p:2x2x2", (2, 4), [100, 200], 300),
    # v5e/v6e: 50/100 GB/s ports, wraparound only along the pod's length-16 dimensions
    ("v5e:16x16", (16, 16), [100, 100], 200),
    ("v5e:4x8", (4, 8), [50, 50], 100),
    ("v6e:16x16", (16, 16), [200, 200], 400),
])
def test_torus_axes_priced_by_the_dimensions_they_span(text, shape, axis_gbps, group_gbps):
    cluster = Cluster.parse(text)
    mesh = _mesh(*shape)
    assert [round(_gbps(link)) for link in cluster.axis_links(mesh)] == axis_gbps
    groups = dict(cluster.group_links(mesh))
    if group_gbps is not None:
        assert round(_gbps(groups[tuple(range(len(shape)))])) == group_gbps
    assert cluster.inter_host_axes(mesh) == ()


def test_collective_times_on_a_torus_against_hand_computed_rings():
    """An all-gather of 1 GB over the 16-chip axis of a 4x16 mesh on a v5p 4x4x4 cube: 15 ring steps
    at the ICI latency, 15/16 GB over 4 ports (two wrapped dimensions, both directions). An all-reduce
    over both axes: all 6 ports, the faster of the ring (2 x 63 steps, 2 x 63/64 GB) and the tree
    (2 log2(64) steps, 2 GB)."""
    cm = CostModel.build(_mesh(4, 16), "v5p:4x4x4")
    assert cm.collective_time("all-gather", 1e9, (1,)) == pytest.approx(15 * V5P_ICI_LAT + 15 / 16 * 1e9 / (4 * V5P_PORT))
    ring = 126 * V5P_ICI_LAT + 2 * 63 / 64 * 1e9 / (6 * V5P_PORT)
    tree = 12 * V5P_ICI_LAT + 2 * 1e9 / (6 * V5P_PORT)
    assert cm.collective_time("all-reduce", 1e9, (0, 1)) == pytest.approx(min(ring, tree))
    # the same devices described as hosts on a network (the old `16x4:v5p`) cross DCN for axis 1
    legacy = CostModel.build(_mesh(4, 16), "16x4:v5p")
    assert legacy.collective_time("all-gather", 1e9, (1,)) > 20 * cm.collective_time("all-gather", 1e9, (1,))


def test_multislice_crosses_dcn_only_between_slices():
    cluster = Cluster.parse("2xv5p:4x4x4")
    assert (cluster.hosts, cluster.devices_per_host, cluster.physical_hosts) == (2, 64, 32)
    mesh = _mesh(2, 64)
    dcn = get_hardware("v5p")
    links = cluster.axis_links(mesh)
    assert links[0] == AxisLink(dcn.inter_latency, pytest.approx(1 / dcn.inter_bandwidth))  # 6.25 GB/s per chip
    assert round(_gbps(links[1])) == 600
    assert cluster.inter_host_axes(mesh) == (0,)
    # an axis spanning both slices and part of each: DCN (the slowest level it crosses); split as MaxText writes it
    assert cluster.inter_host_axes(_mesh(4, 32)) == (0,)
    assert cluster.topology.split_axes((4, 32)) == ((2, 2), (1, 32))
    assert cluster.topology.split_axes((2, 64)) == ((2, 1), (1, 64))


def test_nvl72_prices_every_axis_inside_a_rack_at_nvlink():
    """Two GB200 NVL72 racks: any group of GPUs inside one rack runs at NVLink 5's 900 GB/s per
    direction (not InfiniBand, although 18 trays of 4 GPUs are 18 hosts); between racks 50 GB/s."""
    cluster = Cluster.parse("gb200-nvl72:2")
    gb200 = get_hardware("gb200")
    assert (cluster.hosts, cluster.devices_per_host, cluster.physical_hosts, cluster.num_devices) == (2, 72, 36, 144)
    cm = CostModel.for_cluster(_mesh(2, 4, 18), cluster)
    nbytes = 4e9
    nvlink = AxisLink(2e-6, 1 / 900e9)
    ring = 2 * 71 * 2e-6 + 2 * 71 / 72 * nbytes / 900e9
    tree = 2 * 7 * 2e-6 + 2 * nbytes / 900e9  # ceil(log2 72) = 7 rounds up and down
    assert cm.collective_time("all-reduce", nbytes, (1, 2)) == pytest.approx(min(ring, tree))
    assert cm.collective_time("all-gather", nbytes, (2,)) == pytest.approx(ring_time("all-gather", nbytes, 18, nvlink))
    ib = AxisLink(gb200.inter_latency, 1 / 50e9)
    assert cm.collective_time("all-reduce", nbytes, (0,)) == pytest.approx(
        min(ring_time("all-reduce", nbytes, 2, ib), 2 * ib.alpha + 2 * nbytes * ib.beta))
    # described as 36 hosts of 4 (trays on InfiniBand), the rack's axes would cross the slow link
    assert Cluster.parse("36x4:gb200").inter_host_axes(_mesh(2, 4, 18)) == (0, 1, 2)


def test_topology_texts_round_trip_and_bad_ones_are_one_line():
    for text in ("v5p:8x8x8", "2xv5p:8x8x8", "gb200-nvl72:2", "v6e:16x16", "4xv5e:16x16"):
        cluster = Cluster.parse(text)
        assert str(cluster) == text and Cluster.parse(str(cluster)) == cluster
        assert Cluster.is_cluster(text) and get_hardware(text) is cluster.hardware
    for bad, needle in (("v5p:8x8", "3-D torus"), ("v5e:4x4x4", "2-D torus"), ("0xv5p:4x4x4", "slices")):
        with pytest.raises(ValueError, match=needle):
            Cluster.parse(bad)


def test_plan_options_price_a_submesh_of_the_topology():
    """A mesh smaller than the cluster (a pipeline stage's) is priced on the cluster's first devices;
    --inter-host / --intra-host override the DCN level and one ICI port."""
    cm = cost_model_for(_mesh(4, 4), PlanOptions(hardware="2xv5p:4x4x4"))
    assert [round(_gbps(link)) for link in cm.links] == [200, 200]
    cm = cost_model_for(_mesh(2, 64), PlanOptions(hardware="2xv5p:4x4x4", inter_host="100Gbit", intra_host="50GB/s"))
    assert _gbps(cm.links[0]) == pytest.approx(12.5 / 4)  # one 4-chip host's 100 Gbit/s, per chip
    assert round(_gbps(cm.links[1])) == 300  # 6 ports of 50 GB/s


def _fake_tpus(shape, slices=1, kind="TPU v5p", seed=0):
    rng = np.random.default_rng(seed)
    devs = []
    for s in range(slices):
        for c in np.ndindex(*shape):
            devs.append(types.SimpleNamespace(coords=tuple(int(v) for v in c), slice_index=s, device_kind=kind,
                                              platform="tpu", id=len(devs)))
    order = rng.permutation(len(devs))
    return [devs[i] for i in order]


def test_live_tpu_devices_give_their_topology():
    topo, hw = from_devices(_fake_tpus((2, 2, 4), slices=2))
    assert str(topo) == "2xv5p:2x2x4" and hw.name == "tpu-v5p"
    topo, _ = from_devices(_fake_tpus((16, 16), kind="TPU v6 lite"))
    assert str(topo) == "v6e:16x16" and topo.levels[0].wrap == (True, True)
    assert from_devices(jax.devices()) is None  # CPU devices carry no coordinates


def test_emitted_mesh_orders_devices_as_the_plan_priced_them():
    """8 CPU devices given fake torus coordinates (a v5p 2x2x2 slice, shuffled): the jax Mesh the plan
    builds places them in topology order, so each mesh axis runs along the torus dimensions its
    link was priced by."""
    devices = jax.devices()
    assert len(devices) == 8
    rng = np.random.default_rng(1)
    coords = {d.id: c for d, c in zip(devices, rng.permutation(list(np.ndindex(2, 2, 2))))}
    topo, _ = parse_topology("v5p:2x2x2")
    ordered = device_order(devices, topo, coords_of=lambda d: (0, tuple(int(v) for v in coords[d.id])))
    mesh = MeshSpec((2, 4), ("x", "y")).to_jax_mesh(ordered)
    for (i, j), d in np.ndenumerate(mesh.devices):
        assert tuple(coords[d.id]) == np.unravel_index(i * 4 + j, (2, 2, 2))
    # axis y (4 devices) spans torus dimensions 1 and 2, axis x dimension 0: what the pricing assumed
    grid = np.array([[coords[d.id] for d in row] for row in mesh.devices])  # [2, 4, 3]
    assert (grid[:, :, 0] == grid[:, :1, 0]).all() and len({tuple(c) for c in grid[0, :, 1:]}) == 4
    cluster = Cluster.parse("v5p:2x2x2")
    assert [round(_gbps(link)) for link in cluster.axis_links(MeshSpec((2, 4), ("x", "y")))] == [100, 200]


def test_plan_parallel_on_a_topology_matches_the_unsharded_step():
    """The decorator planning for `v5p:2x2x2` (8 CPU devices stand in for the slice) runs the step
    and matches it unsharded."""
    import optax
    import planner

    rng = np.random.default_rng(0)
    params = {"w1": jax.numpy.asarray(rng.standard_normal((32, 64)), jax.numpy.float32),
              "w2": jax.numpy.asarray(rng.standard_normal((64, 16)), jax.numpy.float32)}
    x = jax.numpy.asarray(rng.standard_normal((16, 32)), jax.numpy.float32)
    y = jax.numpy.asarray(rng.standard_normal((16, 16)), jax.numpy.float32)
    opt = optax.sgd(0.1)

    def step(params, state, x, y):
        def loss(p):
            return jax.numpy.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    want = jax.jit(step)(params, state, x, y)
    planned = planner.plan_parallel(step, hardware="v5p:2x2x2", solver_time_limit=10)
    got = planned(params, state, x, y)
    # float32 throughout: sharded contractions reorder sums of 32-64 terms
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    plan = planned.plan(params, state, x, y)
    assert plan.options.hardware == "v5p:2x2x2" and len(plan.prediction.collectives) > 0


def test_cli_topology_clusters(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", "2xv5p:2x2x2", "--quiet", "--time-limit", "5",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "2xv5p:2x2x2 (16 devices" in text and "as MaxText sets it" in text and "dcn_" in text
    data = json.loads(out.read_text())
    assert data["options"]["hardware"] == "2xv5p:2x2x2"
    split = data["context"]["topology"]["split"]
    assert math.prod(a * b for a, b in split) == 16 and math.prod(a for a, _ in split) == 2
    # a levels file: one 8-GPU NVLink host level, two hosts on a 100 Gbit/s-per-GPU network
    levels = tmp_path / "levels.json"
    levels.write_text(json.dumps({"hardware": "h100", "devices_per_host": 8, "levels": [
        {"name": "nvlink", "size": 8, "link": "450GB/s,2us"}, {"name": "ib", "size": 2, "link": "12.5GB/s,10us"}]}))
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", str(levels), "--mesh", "2x8", "--quiet",
                     "--time-limit", "5", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    opts = json.loads(out.read_text())["options"]
    cm = cost_model_for(MeshSpec((2, 8), ("x", "y")), PlanOptions.from_json(opts))
    assert _gbps(cm.links[0]) == pytest.approx(12.5) and _gbps(cm.links[1]) == pytest.approx(450)
    for argv, needle in ((["--cluster", "v5p:8x8"], "3-D torus"), (["--cluster", "v5p:2x2x2", "--hardware", "h100"],
                                                                    "give it once")):
        code = cli.main(["plan", "--model", "mlp-tiny", "--quiet"] + argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and needle in err and len(err.splitlines()) == 1, err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"levels": [{"size": 8}]}))
    code = cli.main(["plan", "--model", "mlp-tiny", "--quiet", "--cluster", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs 'size' and 'link'" in err and len(err.splitlines()) == 1, err


def test_decorator_reads_the_topology_of_live_tpu_devices():
    """Planned on devices that carry torus coordinates (faked: a v5p 2x2x2 slice, shuffled), the
    decorator prices that topology and lays meshes over the devices in its order; CPU devices carry
    none and keep theirs."""
    from planner.planning.step import StepPlanner

    fake = _fake_tpus((2, 2, 2), seed=3)
    sp = StepPlanner.create(devices=fake)
    assert sp.options.hardware == "v5p:2x2x2"
    assert [d.coords for d in sp.devices] == list(np.ndindex(2, 2, 2))
    sp = StepPlanner.create(devices=fake, hardware="h100")  # another kind named: the user's word stands
    assert sp.options.hardware == "h100" and list(sp.devices) == fake
    sp = StepPlanner.create()
    assert sp.options.hardware is None and list(sp.devices) == jax.devices()


def test_profile_levels_serve_another_shape_of_the_same_hardware():
    """A profile measures each level alone (an axis inside a host, an axis across hosts); its
    per-level links then price a topology of another shape: here 2 hosts x 4 measured, 4 x 4 planned."""
    from planner.cost_model.profile_db import ProfileDB
    from planner.cost_model.profile_levels import measured_levels
    from planner.cost_model.profiling import summary
    from planner.cost_model.topology import levels_text, topology_from_levels
    from planner.core.units import parse_link

    intra, inter = AxisLink(5e-6, 1 / 20e9), AxisLink(40e-6, 1 / 2e9)
    db = ProfileDB.synthetic((2, 4), [inter, intra], host_of=(0,) * 4 + (1,) * 4)
    levels = measured_levels(db)
    assert levels[0].bandwidth == pytest.approx(20e9, rel=1e-6) and levels[0].latency == pytest.approx(5e-6, rel=1e-3)
    assert levels[1].bandwidth == pytest.approx(2e9, rel=1e-6) and levels[1].latency == pytest.approx(40e-6, rel=1e-3)
    assert "level host" in summary(db) and "level network" in summary(db)
    cpu = get_hardware("cpu")
    target = topology_from_levels([{"name": "host", "size": 4, "link": "1GB/s"}, {"name": "network", "size": 4,
                                                                                  "link": "0.1GB/s"}],
                                  cpu, 4, parse_link, "test")
    cm = CostModel.build(_mesh(4, 4), levels_text(target, cpu), profile=db)
    assert _gbps(cm.links[0]) == pytest.approx(2, rel=1e-6) and _gbps(cm.links[1]) == pytest.approx(20, rel=1e-6)


def test_profile_of_one_slice_serves_a_larger_slice():
    """Measured on a v5p 2x2x2 slice (no wraparound: every axis one port each way) at 80 GB/s per
    port, the profile prices a 4x4x4 cube: an axis on a wrapped dimension 2 x 80, two dimensions 4 x 80."""
    import dataclasses as dc

    from planner.cost_model.profile_db import ProfileDB
    from planner.cost_model.profile_levels import measured_levels

    port = AxisLink(4e-6, 1 / 80e9)
    db = ProfileDB.synthetic((2, 2, 2), [port] * 3, device_kind="TPU v5p", platform="tpu")
    db = dc.replace(db, topology="v5p:2x2x2")
    assert measured_levels(db)[0].bandwidth == pytest.approx(80e9, rel=1e-6)
    cm = CostModel.build(_mesh(4, 16), "v5p:4x4x4", profile=db)
    assert [round(_gbps(link)) for link in cm.links] == [160, 320]
    assert round(_gbps(cm.link_of((0, 1)))) == 480
    assert cm.links[0].alpha == pytest.approx(4e-6, rel=1e-3)
