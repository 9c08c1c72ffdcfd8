"""The profile database: JSON round trip, atomic writes, and clear errors for unusable files."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest

from planner.cost_model import AxisLink, CostModel, ProfileDB, ProfileWarning, load_profile
from planner.cost_model.fit import geometric_sizes
from planner.cost_model.profile_db import write_json_atomic
from planner.core.errors import ProfileError
from planner.core.mesh import MeshSpec
from planner.search.mesh_plan import cost_model_for
from planner.core.options import PlanOptions

MESH = MeshSpec((2, 4), ("x", "y"))
FAST, SLOW = AxisLink(5e-6, 1e-10), AxisLink(50e-6, 1e-9)


def small_db(**kw) -> ProfileDB:
    return ProfileDB.synthetic(MESH, (SLOW, FAST), sizes=geometric_sizes(1024, 2**20), host_of=(0,) * 4 + (1,) * 4,
                               matmul_flops={"float32": 2e10, "bfloat16": 3e10}, memory_bandwidth=5e9, **kw)


def test_round_trip_through_a_file(tmp_path):
    db = dataclasses.replace(small_db(), host_bandwidth=5.3e10)
    path = tmp_path / "profile.json"
    db.save(path)
    back = ProfileDB.load(path)
    assert back.path == str(path)
    assert back.to_json() == db.to_json()
    data = json.loads(path.read_text())
    assert data["format"] == "planner-profile" and data["version"] == 1
    assert data["device_kind"] == "cpu" and data["num_devices"] == 8 and data["mesh"]["shape"] == [2, 4]
    first = data["collectives"][0]
    assert {"collective", "axes", "devices", "samples", "fit"} <= set(first)
    assert {"alpha", "beta"} <= set(first["fit"])
    assert load_profile(str(path)).to_json() == db.to_json()
    assert load_profile(data).to_json() == db.to_json()
    assert load_profile(db) is db
    assert back.host_bandwidth == 5.3e10 and data["compute"]["host_bandwidth"] == 5.3e10


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path):
    path = tmp_path / "profile.json"
    small_db().save(path)
    before = path.read_text()

    class Boom:
        """Not JSON-serialisable: json.dump fails half way through."""

    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": list(range(1000)), "b": Boom()})
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["profile.json"]  # no temporary file left behind


def _corrupt(tmp_path, text: str):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        ProfileDB.load(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_corrupt_files_give_profile_errors_naming_file_and_problem(tmp_path):
    good = json.dumps(small_db().to_json())
    assert "not valid JSON" in _corrupt(tmp_path, good[: len(good) // 2])
    assert "not valid JSON" in _corrupt(tmp_path, "")
    assert "top level" in _corrupt(tmp_path, "[1, 2]")
    assert "not a planner profile" in _corrupt(tmp_path, json.dumps({"hello": 1}))
    data = json.loads(good)
    data["version"] = 99
    assert "version 99" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    del data["collectives"][0]["fit"]
    assert "'collectives[0].fit' is missing" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    data["collectives"][1]["samples"][0]["seconds"] = ["fast"]
    assert "collectives[1].samples[0].seconds[0]" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    data["collectives"][2]["collective"] = "all-sum"
    assert "all-sum" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    data["num_devices"] = 4
    assert "num_devices=4" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    data["compute"]["host_bandwidth"] = 0
    assert "compute.host_bandwidth=0" in _corrupt(tmp_path, json.dumps(data))
    data = json.loads(good)
    data["collectives"][0]["fit"]["beta"] = -1.0
    assert "beta=-1.0" in _corrupt(tmp_path, json.dumps(data))
    with pytest.raises(ProfileError, match="no such file"):
        ProfileDB.load(tmp_path / "missing.json")
    with pytest.raises(ProfileError, match="neither a file path"):
        load_profile(42)


def test_other_device_kind_or_count_is_an_error():
    with pytest.raises(ProfileError, match="'TPU v4' devices but this process has 'cpu'.*hardware='tpu-v4'"):
        CostModel.from_profile(MESH, small_db(device_kind="TPU v4"), device_kind="cpu")
    with pytest.raises(ProfileError, match="hardware='h100-sxm' was requested"):
        CostModel.from_profile(MESH, small_db(), hardware="h100")
    # the profiled hardware, named explicitly, is fine from a machine with other devices
    CostModel.from_profile(MESH, small_db(device_kind="TPU v4"), hardware="tpu-v4", device_kind="cpu")
    with pytest.raises(ProfileError, match="measured on 8 devices.*has 16"):
        CostModel.from_profile(MeshSpec((4, 4), ("x", "y")), small_db(), device_kind="cpu")


def test_other_mesh_shape_serves_with_a_warning():
    db = small_db()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = CostModel.from_profile(MESH, db, device_kind="cpu")  # no warning on the profiled mesh
        # a 1-D mesh over the same 8 devices is the profiled x*y group: fully measured, no warning
        flat = CostModel.from_profile(MeshSpec((8,), ("x",)), db, device_kind="cpu")
    assert flat.collective_time("all-gather", 2**16, (0,)) == same.collective_time("all-gather", 2**16, (0, 1))
    # size-1 axes do not hide a measured group
    padded = CostModel.from_profile(MeshSpec((1, 2, 4), ("p", "x", "y")), db, device_kind="cpu")
    assert padded.algorithm("all-reduce", 2**16, (0, 1)) == "measured"
    assert padded.collective_time("all-reduce", 2**16, (0, 1)) == same.collective_time("all-reduce", 2**16, (0,))
    mesh = MeshSpec((2, 2, 2), ("x", "y", "z"))
    with pytest.warns(ProfileWarning, match=r"mesh 2x4, not 2x2x2.*\by\b.*\bz\b"):
        cm = CostModel.from_profile(mesh, db, device_kind="cpu")
    assert cm.algorithm("all-reduce", 2**16, (0,)) == "measured"  # stride-4 pairs: the profiled x axis
    assert cm.algorithm("all-reduce", 2**16, (1, 2)) == "measured"  # 4 neighbours: the profiled y axis
    assert cm.algorithm("all-reduce", 2**16, (2,)) in ("ring", "tree")  # never measured: analytic
    # the analytic fallback knows the profiled host layout: axis 0 crosses hosts, 2 does not
    assert cm.links[0] != cm.links[2]


def test_cost_model_for_reads_the_profile_option(tmp_path):
    path = tmp_path / "profile.json"
    small_db().save(path)
    cm = cost_model_for(MESH, PlanOptions(profile=str(path)))
    assert cm.measured is not None and cm.measured.source == str(path)
    assert cm.hardware.name == "cpu" and cm.hardware.flops_f32 == 2e10 and cm.hardware.memory_bandwidth == 5e9
    assert cost_model_for(MESH, PlanOptions()).measured is None
    path.write_text("{ broken")
    with pytest.raises(ProfileError, match="not valid JSON"):
        cost_model_for(MESH, PlanOptions(profile=str(path)))
