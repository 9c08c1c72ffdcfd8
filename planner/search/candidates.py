"""Candidate meshes: the mesh shapes a search tries, their inter-host axes, and which are one problem."""
from __future__ import annotations

import math
from collections.abc import Sequence

from planner.core.mesh import MeshSpec, default_axis_names
from planner.cost_model import Cluster


def candidate_meshes(num_devices: int, max_ndim: int = 2) -> list[MeshSpec]:
    """Logical mesh shapes to try when the user gives none: (n,), every 2-D factorisation, and with
    `max_ndim=3` every 3-D one with axes of at least 2 (e.g. data x fsdp x tensor)."""
    out = [MeshSpec((num_devices,), default_axis_names(1))]
    divisors = [a for a in range(2, num_devices) if num_devices % a == 0]
    if max_ndim >= 2:
        out += [MeshSpec((a, num_devices // a), default_axis_names(2)) for a in divisors]
    if max_ndim >= 3:
        out += [MeshSpec((a, b, num_devices // (a * b)), default_axis_names(3)) for a in divisors for b in divisors
                if num_devices % (a * b) == 0 and num_devices // (a * b) >= 2]
    return out


def default_mesh_ndim(mesh_ndim: int | None, hosts: int) -> int:
    """The most mesh axes a search tries: `mesh_ndim` when given, else 3 for devices on several
    hosts (where a third axis lets, e.g., the batch cross hosts while parameters are split over part
    of each host and the tensor dimensions over the rest), 2 on one host (where a third axis costs
    search time and seldom beats the best 2-D plan)."""
    return mesh_ndim if mesh_ndim is not None else 3 if hosts > 1 else 2


def inter_host_axes(shape: Sequence[int], devices_per_host: int) -> tuple[int, ...]:
    """Mesh axes whose device groups span more than one host, for devices numbered host-major
    (host h owns devices h*D ... h*D+D-1) and laid out row-major on the mesh, as `jax.make_mesh`
    does for a uniform cluster."""
    size = math.prod(shape)
    cluster = Cluster(max(1, size // devices_per_host), min(size, devices_per_host))
    return cluster.inter_host_axes(MeshSpec(tuple(shape), default_axis_names(len(shape))))


def mirror_key(spec: MeshSpec, inter: Sequence[int]) -> tuple:
    """Meshes with equal keys are one planning problem: the same axis sizes on the same links, in
    another order (2x4 and 4x2 inside one host). The cost model sees an axis only through its size
    and its link (inter-host or not), and strategies range over every assignment of axes to
    dims, so a permutation of the axes permutes the plans and leaves every predicted number as it is
    (a profile measures each axis group separately, so `search_meshes` does not use this then)."""
    return tuple(sorted((size, axis in inter) for axis, size in enumerate(spec.shape)))
