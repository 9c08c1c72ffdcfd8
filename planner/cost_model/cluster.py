"""A cluster: hosts x devices per host, and the links inside and between hosts.

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
from planner.cost_model.hardware import (
    CLUSTER_PATTERN,
    DEFAULT_HARDWARE,
    Hardware,
    get_hardware,
)
from planner.core.mesh import MeshSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One direction of a per-device link: bandwidth (bytes/s) and latency (s)."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (self.bandwidth > 0 and self.latency >= 0):
            raise ValueError(f"link bandwidth={self.bandwidth!r} must be > 0 and latency={self.latency!r} >= 0")

    def axis_link(self) -> AxisLink:
        return AxisLink(self.latency, 1.0 / self.bandwidth)


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    """`hosts` hosts of `devices_per_host` devices of one `hardware` kind.

    Attributes:
      hosts: number of hosts (processes in a `jax.distributed` run).
      devices_per_host: devices on each host.
      hardware: the device kind (compute peaks, default link figures).
      intra: link between devices of one host (default: the hardware's intra-host figures).
      inter: link between hosts, per device (default: the hardware's inter-host figures).
    """

    hosts: int
    devices_per_host: int
    hardware: Hardware = DEFAULT_HARDWARE
    intra: Link | None = None
    inter: Link | None = None

    def __post_init__(self):
        for name in ("hosts", "devices_per_host"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, np.integer)) and v >= 1):
                raise ValueError(f"cluster {name}={v!r} must be an int >= 1")

    @staticmethod
    def is_cluster(text: object) -> bool:
        """Whether `text` is a cluster description ("HOSTSxDEVICES[:PRESET]")."""
        return isinstance(text, str) and CLUSTER_PATTERN.match(text) is not None

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """A cluster from `"HOSTSxDEVICES[:PRESET]"`, e.g. `"4x8:h100"`."""
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

    def host_of(self) -> tuple[int, ...]:
        """Host index of each device, in device order."""
        return tuple(i // self.devices_per_host for i in range(self.num_devices))

    def inter_host_axes(self, mesh: MeshSpec) -> tuple[int, ...]:
        """Mesh axes whose device groups span more than one host."""
        if mesh.size != self.num_devices:
            raise ValueError(f"mesh {mesh} has {mesh.size} devices but cluster {self} has {self.num_devices}")
        return tuple(a for a in range(mesh.ndim) if spans_hosts(mesh, (a,), self.host_of()))

    def axis_links(self, mesh: MeshSpec) -> tuple[AxisLink, ...]:
        inter = set(self.inter_host_axes(mesh))
        return tuple(
            (self.inter_link if a in inter else self.intra_link).axis_link() for a in range(mesh.ndim)
        )

    def __str__(self) -> str:
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
