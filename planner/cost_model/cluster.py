"""A cluster: hosts x devices per host, and the links inside and between hosts; or a topology.

`HOSTSxDEVICES[:PRESET]` clusters are priced here as below. Clusters described by their topology
(`v5p:8x8x8`, `2xv5p:8x8x8`, `gb200-nvl72:2`; `cost_model.topology`) count their fast domains (a
slice, an NVLink rack) as the "hosts" of the search (pipeline stages, inter-host axes) and price
every mesh axis and axis group by the levels and torus dimensions it spans.

A logical mesh is laid out row-major over the cluster's devices in order (host 0's devices first,
as `jax.devices()` orders them and `MeshSpec.to_jax_mesh` places them). A mesh axis whose groups
of devices span more than one host runs over the inter-host link; the others stay on the intra-host
link. For a row-major layout these are the leading axes whose stride reaches a host boundary.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from planner.cost_model.collectives import AxisLink
from planner.cost_model.topology import Link, Topology, is_topology, parse_topology, two_level
from planner.cost_model.hardware import (
    CLUSTER_PATTERN,
    DEFAULT_HARDWARE,
    Hardware,
    get_hardware,
)
from planner.core.mesh import MeshSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    """`hosts` hosts of `devices_per_host` devices of one `hardware` kind.

    Attributes:
      hosts: number of hosts (processes in a `jax.distributed` run).
      devices_per_host: devices on each host.
      hardware: the device kind (compute peaks, default link figures).
      intra: link between devices of one host (default: the hardware's intra-host figures).
      inter: link between hosts, per device (default: the hardware's inter-host figures).
      topology: for clusters described by their topology: its levels; `hosts` and
        `devices_per_host` are then its fast domains (level 0 units) and their size.
    """

    hosts: int
    devices_per_host: int
    hardware: Hardware = DEFAULT_HARDWARE
    intra: Link | None = None
    inter: Link | None = None
    topology: Topology | None = None

    def __post_init__(self):
        for name in ("hosts", "devices_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, np.integer)) and v >= 1):
                raise ValueError(f"cluster {name}={v!r} must be an int >= 1")
        t = self.topology
        if t is not None and (t.domains, t.domain_size) != (self.hosts, self.devices_per_host):
            raise ValueError(f"cluster {self.hosts}x{self.devices_per_host} does not match its topology {t} "
                             f"({t.domains} domains of {t.domain_size})")

    @staticmethod
    def is_cluster(text: object) -> bool:
        """Whether `text` is a cluster description ("HOSTSxDEVICES[:PRESET]" or a topology)."""
        return isinstance(text, str) and (CLUSTER_PATTERN.match(text) is not None or is_topology(text))

    @classmethod
    def of_topology(cls, topology: Topology, hardware: Hardware) -> Cluster:
        return cls(topology.domains, topology.domain_size, hardware, topology=topology)

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """A cluster from `"HOSTSxDEVICES[:PRESET]"`, e.g. `"4x8:h100"`, or a topology such as
        `"v5p:8x8x8"`, `"2xv5p:8x8x8"` or `"gb200-nvl72:2"`."""
        if is_topology(text):
            return cls.of_topology(*parse_topology(text))
        m = CLUSTER_PATTERN.match(text)
        if not m:
            raise ValueError(f"cluster {text!r} is not of the form 'HOSTSxDEVICES[:PRESET]', e.g. '4x8:h100'")
        return cls(int(m.group(1)), int(m.group(2)), get_hardware(m.group(3)) if m.group(3) else DEFAULT_HARDWARE)

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def intra_link(self) -> Link:
        return self.intra or Link(self.hardware.intra_bandwidth, self.hardware.intra_latency)

    @property
    def inter_link(self) -> Link:
        return self.inter or Link(self.hardware.inter_bandwidth, self.hardware.inter_latency)

    @property
    def topo(self) -> Topology:
        """The topology: the described one, or two switched levels (host, network)."""
        if self.topology is not None:
            return self.topology
        return two_level(self.hosts, self.devices_per_host, self.intra_link, self.inter_link)

    @property
    def physical_hosts(self) -> int:
        """Processes (TPU VMs, servers, trays) of the cluster."""
        if self.topology is None:
            return self.hosts
        return max(1, self.num_devices // self.topology.devices_per_host)

    def with_links(self, hardware: Hardware) -> Cluster:
        """This cluster on `hardware` whose intra/inter links were overridden (`hardware_with_links`):
        for a topology, level 0's link becomes the intra-host figure (one port of a torus) and the
        outermost level's the inter-host one."""
        if self.topology is None:
            return dataclasses.replace(self, hardware=hardware)
        levels = list(self.topology.levels)
        if hardware.intra_bandwidth != self.hardware.intra_bandwidth or \
                hardware.intra_latency != self.hardware.intra_latency:
            levels[0] = dataclasses.replace(levels[0], link=Link(hardware.intra_bandwidth, hardware.intra_latency))
        if len(levels) > 1 and (hardware.inter_bandwidth != self.hardware.inter_bandwidth
                                or hardware.inter_latency != self.hardware.inter_latency):
            levels[-1] = dataclasses.replace(levels[-1], link=Link(hardware.inter_bandwidth, hardware.inter_latency))
        topo = dataclasses.replace(self.topology, levels=tuple(levels))
        return dataclasses.replace(self, hardware=hardware, topology=topo)

    def host_of(self) -> tuple[int, ...]:
        """Host index of each device, in device order."""
        return tuple(i // self.devices_per_host for i in range(self.num_devices))

    def inter_host_axes(self, mesh: MeshSpec) -> tuple[int, ...]:
        """Mesh axes whose device groups span more than one host."""
        if mesh.size != self.num_devices:
            raise ValueError(f"mesh {mesh} has {mesh.size} devices but cluster {self} has {self.num_devices}")
        return tuple(a for a in range(mesh.ndim) if spans_hosts(mesh, (a,), self.host_of()))

    def group_links(self, mesh: MeshSpec) -> tuple[tuple[tuple[int, ...], AxisLink], ...]:
        """Links of groups of several axes where the topology prices them otherwise than by their
        slowest axis (tori: a group over several dimensions uses all their ports); () otherwise."""
        if self.topology is None or not any(lv.torus for lv in self.topology.levels):
            return ()
        return self.topology.mesh_links(mesh.shape)[1]

    def axis_links(self, mesh: MeshSpec) -> tuple[AxisLink, ...]:
        if self.topology is not None:
            if mesh.size != self.num_devices:
                raise ValueError(f"mesh {mesh} has {mesh.size} devices but cluster {self} has {self.num_devices}")
            return self.topology.mesh_links(mesh.shape)[0]
        inter = set(self.inter_host_axes(mesh))
        return tuple(
            (self.inter_link if a in inter else self.intra_link).axis_link() for a in range(mesh.ndim)
        )

    def describe(self) -> str:
        """In words, for reports: "2 hosts x 8 devices" or the topology's levels."""
        if self.topology is None:
            return f"{self.hosts} hosts x {self.devices_per_host} devices"
        return f"{self.topology} ({self.num_devices} devices: {self.topology.describe()})"

    def __str__(self) -> str:
        if self.topology is not None:
            return str(self.topology)
        return f"{self.hosts}x{self.devices_per_host}:{self.hardware.name}"


def device_grid(mesh: MeshSpec) -> np.ndarray:
    """Device positions (0..size-1) of the row-major layout, shaped like the mesh."""
    return np.arange(mesh.size).reshape(mesh.shape)


def group_offsets(mesh: MeshSpec, axes: Sequence[int]) -> tuple[int, ...]:
    """Positions of the devices in the group of `axes` that contains device 0.

    Two axis groups of different meshes with equal offsets connect the same devices over the same
    links, which is how a profile measured on one mesh serves another.
    """
    grid = device_grid(mesh)
    index = tuple(slice(None) if a in axes else 0 for a in range(mesh.ndim))
    return tuple(sorted(int(i) for i in grid[index].ravel()))


def spans_hosts(mesh: MeshSpec, axes: Sequence[int], host_of: Sequence[int]) -> bool:
    """Whether any group of `axes` holds devices of more than one host."""
    if not axes:
        return False
    hosts = np.asarray(host_of)[device_grid(mesh)]
    others = [a for a in range(mesh.ndim) if a not in axes]
    grouped = np.transpose(hosts, others + sorted(axes)).reshape(-1, mesh.axis_size(axes))
    return bool((grouped != grouped[:, :1]).any())
