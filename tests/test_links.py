"""Link speeds as the user gives them: bandwidth and latency units, --inter-host / --intra-host flags
and cluster files reaching the cost model, one-line errors for bad values."""
from __future__ import annotations

import json
import math

import pytest

from planner import cli
from planner.cost_model import PRESETS, AxisLink, hardware_with_links
from planner.core.errors import InvalidArgumentError
from planner.core.mesh import MeshSpec
from planner.core.options import PlanOptions
from planner.search.mesh_plan import cost_model_for
from planner.core.units import parse_bandwidth, parse_duration, parse_link


def test_units_of_links():
    assert parse_bandwidth("25Gbit") == parse_bandwidth("25Gbps") == parse_bandwidth("3.125GB/s") == 3.125e9
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_duration("10us") == pytest.approx(1e-5) and parse_duration("2ms") == pytest.approx(2e-3)
    assert parse_link("100Gbit,5us") == (12.5e9, pytest.approx(5e-6))
    for bad in ("fast", "25G", "0Gbit", "-1GB/s"):
        with pytest.raises(InvalidArgumentError):
            parse_bandwidth(bad)


def test_alpa_cluster_links_reach_the_cost_model():
    """8 V100 per host on 25 Gbit/s (Alpa's testbed): 0.39 GB/s per device between hosts."""
    hw = hardware_with_links("v100", inter_host="25Gbit")
    assert hw.inter_bandwidth == pytest.approx(25e9 / 8 / 8)
    mesh = MeshSpec((8, 8), ("x", "y"))
    cm = cost_model_for(mesh, PlanOptions(hardware="8x8:v100", inter_host="25Gbit,20us", intra_host="100GB/s"))
    assert cm.links[0] == AxisLink(pytest.approx(20e-6), pytest.approx(8 * 8 / 25e9))
    assert cm.links[1] == AxisLink(PRESETS["v100-16gb"].intra_latency, pytest.approx(1 / 100e9))
    with pytest.raises(InvalidArgumentError):
        PlanOptions(inter_host="a lot")


@pytest.mark.parametrize("extra, needle", [
    (["--inter-host", "fast"], "is not a bandwidth"),
    (["--intra-host", "10GB/s,soon"], "is not a duration"),
    (["--inter-host", "25Gbit,0us"], "latency must be positive"),
])
def test_bad_link_flags_are_one_line_exit_2(capsys, extra, needle):
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", "2x4:v100", "--quiet"] + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_cluster_file_and_flags(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"hosts": 2, "devices_per_host": 4, "hardware": "v100", "inter_host": "10Gbit"}))
    out_json = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "mlp-tiny", "--cluster", str(path), "--mesh", "2x4", "--quiet",
                     "--time-limit", "5", "--json", str(out_json)])
    assert code == 0, capsys.readouterr()
    data = json.loads(out_json.read_text())
    assert data["options"]["inter_host"] == "10Gbit"
    assert data["options"]["hardware"] == "2x4:v100-16gb"
    path.write_text(json.dumps({"hosts": 2}))
    assert cli.main(["plan", "--model", "mlp-tiny", "--cluster", str(path), "--quiet"]) == 2
    assert "devices_per_host" in capsys.readouterr().err
    assert math.isclose(hardware_with_links("v100", "10Gbit", None, 4).inter_bandwidth, 10e9 / 8 / 4)



def test_positive_counts_on_the_command_line():
    """One argparse type for every count the CLI and the profiling job take."""
    import argparse

    from planner.core.units import positive_int

    assert positive_int("4") == 4
    for text, message in (("x", "is not an integer"), ("0", "must be >= 1"), ("-3", "must be >= 1")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            positive_int(text)
