"""Where `planner plan` plans for: the device count, the cluster of hosts and the meshes to try."""
from __future__ import annotations

import json
import math
import os
import re

from planner.core.errors import PlannerError, first_line
from planner.core.mesh import MeshSpec, default_axis_names
from planner.cost_model import Cluster, get_hardware, hardware_with_links
from planner.cost_model.topology import Topology, is_topology, levels_text, topology_from_levels
from planner.core.units import parse_link
from planner.search.candidates import candidate_meshes, default_mesh_ndim
from planner.stages.submesh import make_cluster
from planner.cli.errors import CLIError

MESH_SHAPE = re.compile(r"^\s*\d+(\s*x\s*\d+)*\s*$")

_CLUSTER_FILE_KEYS = ("hosts", "devices_per_host", "hardware", "inter_host", "intra_host")


def mesh_devices(text: str) -> int:
    """The device count of a mesh shape such as `2x4` (`MESH_SHAPE`)."""
    return math.prod(int(s) for s in text.replace(" ", "").split("x"))


def parse_cluster(text: str) -> Cluster:
    """The hosts x devices of `"2x8"` or `"2x8:h100"` (the preset, if any, becomes `--hardware`)."""
    try:
        if not Cluster.is_cluster(text):
            raise ValueError("not of the form HOSTSxDEVICES[:PRESET]")
        return Cluster.parse(text.partition(":")[0])
    except ValueError as e:
        raise CLIError(f"--cluster {text!r} is not HOSTSxDEVICES ({e}); write e.g. --cluster 2x8 for 2 hosts with "
                       "8 devices each (optionally 2x8:h100 to name the hardware)") from None


def candidate_specs(args, num_devices: int, hosts: int = 1):
    """The MeshSpecs to plan: the --mesh one, or every candidate shape of the device count (on
    `hosts` hosts: `search.candidates.default_mesh_ndim`)."""
    if args.mesh is not None:
        if not MESH_SHAPE.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        shape = tuple(int(s) for s in args.mesh.replace(" ", "").split("x"))
        if math.prod(shape) != num_devices:
            raise CLIError(f"--mesh {args.mesh} has {math.prod(shape)} devices but the target has {num_devices}; "
                           f"choose sizes whose product is {num_devices}")
        return [MeshSpec(shape, default_axis_names(len(shape)))]
    return candidate_meshes(num_devices, default_mesh_ndim(getattr(args, "mesh_ndim", None), hosts))


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise CLIError(f"--cluster {path!r}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CLIError(f"--cluster {path!r} is not JSON ({e.msg} at line {e.lineno})") from None


def _levels_file(args, path: str, data: dict) -> Cluster:
    """A cluster file with topology levels: {"hardware": PRESET, "devices_per_host": N (optional),
    "levels": [{"name", "size", "link": "BANDWIDTH[,LATENCY]", "torus": [..], "wrap": [..]}, ...]},
    innermost level first (`cost_model.topology.topology_from_levels`)."""
    unknown = sorted(set(data) - {"hardware", "devices_per_host", "levels"})
    if unknown:
        raise CLIError(f"--cluster {path!r}: unknown key(s) {', '.join(unknown)}; a levels file has hardware, "
                       "devices_per_host and levels")
    try:
        hw = get_hardware(data.get("hardware") or args.hardware)
        topo = topology_from_levels(data["levels"], hw, data.get("devices_per_host"), parse_link, "levels")
    except Exception as e:  # noqa: BLE001 - any malformed level: one line naming the file
        raise CLIError(f"--cluster {path!r}: {first_line(e)}") from None
    topo = Topology(topo.levels, topo.devices_per_host, levels_text(topo, hw))
    _claim_hardware(args, repr(path), hw.name)
    return Cluster.of_topology(topo, hw)


def read_cluster_file(args) -> Cluster | None:
    """Reads `--cluster FILE` (JSON) into args.cluster ("HOSTSxDEVICES[:PRESET]") and the link flags
    (a flag given on the command line wins over the file); a file of topology levels is returned
    as its cluster."""
    path = args.cluster
    data = _read_json(path)
    if isinstance(data, dict) and "levels" in data:
        return _levels_file(args, path, data)
    if not isinstance(data, dict) or not {"hosts", "devices_per_host"} <= set(data):
        raise CLIError(f"--cluster {path!r}: expected a JSON object with hosts and devices_per_host (and optionally "
                       "hardware, inter_host, intra_host)")
    unknown = sorted(set(data) - set(_CLUSTER_FILE_KEYS))
    if unknown:
        raise CLIError(f"--cluster {path!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_CLUSTER_FILE_KEYS)}")
    hosts, per_host = data["hosts"], data["devices_per_host"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (hosts, per_host)):
        raise CLIError(f"--cluster {path!r}: hosts={hosts!r} and devices_per_host={per_host!r} must be integers >= 1")
    args.cluster = f"{hosts}x{per_host}" + (f":{data['hardware']}" if data.get("hardware") else "")
    for key in ("inter_host", "intra_host"):
        if getattr(args, key) is None and data.get(key) is not None:
            setattr(args, key, data[key])
    return None


def _topology_target(args, text: str) -> Cluster:
    """A cluster described by its topology (`v5p:8x8x8`, `2xv5p:8x8x8`, `gb200-nvl72:2`); its hardware
    becomes args.hardware."""
    try:
        cluster = Cluster.parse(text)
    except ValueError as e:
        raise CLIError(f"--cluster {text!r}: {e}") from None
    _claim_hardware(args, text, cluster.hardware.name)
    return cluster


def _claim_hardware(args, cluster: str, name: str) -> None:
    """The hardware a topology cluster names becomes args.hardware; a different --hardware is refused."""
    if args.hardware is not None and get_hardware(args.hardware).name != name:
        raise CLIError(f"--cluster {cluster} is {name} hardware but --hardware is {args.hardware!r}; give it once")
    args.hardware = name


def _cluster_target(args) -> Cluster:
    """--cluster (a shape or a file); its hardware preset, if it names one, becomes args.hardware."""
    if args.cluster.strip().lower().endswith(".json") or os.path.isfile(args.cluster):
        topology = read_cluster_file(args)
        if topology is not None:
            return topology
    if is_topology(args.cluster):
        return _topology_target(args, args.cluster)
    cluster = parse_cluster(args.cluster)
    preset = args.cluster.partition(":")[2].strip() or None
    if preset is not None:
        if args.hardware is not None and args.hardware.lower() != preset.lower():
            raise CLIError(f"--cluster {args.cluster} names hardware {preset!r} but --hardware is "
                           f"{args.hardware!r}; give it once")
        args.hardware = preset
    return cluster


def target(args) -> tuple[int, Cluster | None]:
    """(device count, cluster or None) of --devices, --cluster or --mesh."""
    given = [n for n, v in (("--devices", args.devices), ("--cluster", args.cluster)) if v is not None]
    if len(given) > 1:
        raise CLIError("give one of --devices N or --cluster HOSTSxDEVICES, not both")
    if args.cluster is not None:
        cluster = _cluster_target(args)
        return cluster.num_devices, cluster
    if args.devices is not None:
        return args.devices, None
    if args.mesh is not None:
        if not MESH_SHAPE.match(args.mesh):
            raise CLIError(f"--mesh {args.mesh!r} is not a shape like 2x4; write the axis sizes joined by 'x'")
        return mesh_devices(args.mesh), None
    raise CLIError("say where to plan for: --devices N, --mesh 2x4 or --cluster HOSTSxDEVICES")


def pipeline_target(args, cluster: Cluster | None, num_devices: int) -> Cluster:
    """The cluster pipelines are planned for: --cluster (or --devices as one host) with the links
    --inter-host / --intra-host give."""
    hosts, per_host = (cluster.hosts, cluster.devices_per_host) if cluster else (1, num_devices)
    try:
        if cluster is not None and cluster.topology is not None:
            return cluster.with_links(hardware_with_links(cluster.hardware, args.inter_host, args.intra_host,
                                                          cluster.topology.devices_per_host))
        linked = hardware_with_links(args.hardware, args.inter_host, args.intra_host, per_host)
        return make_cluster(hosts, per_host, linked)
    except (ValueError, PlannerError) as e:
        raise CLIError(f"cannot build the {hosts}x{per_host} cluster: {e}") from None
