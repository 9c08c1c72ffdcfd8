"""Submesh shapes of a cluster, and the logical meshes each submesh can be viewed as.

The cluster is `planner.cost_model.Cluster`: `hosts` hosts of `devices_per_host` devices; links
inside a host are fast, links between hosts slow. Pipeline stages run on submeshes of the shapes Alpa showed can always
tile the cluster: `(1, 1), (1, 2), (1, 4) ... (1, M)` (part of one host, powers of two) and
`(2, M) ... (N, M)` (whole hosts). Each submesh is planned as one or more logical meshes; a mesh
axis that spans hosts gets the inter-host link in the cost model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.cost_model import AxisLink, Cluster, CostModel, Hardware, Link, get_hardware
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError
from planner.core.mesh import MeshSpec, default_axis_names

Shape = tuple[int, ...]


def make_cluster(hosts: int, devices_per_host: int, hardware: str | Hardware | None = None,
                 inter_host_gbit: float | None = None) -> Cluster:
    """A `planner.cost_model.Cluster`; `inter_host_gbit` is one host's network bandwidth in Gbit/s,
    shared by its devices (Alpa's testbed: `make_cluster(8, 8, "v100", inter_host_gbit=25)`)."""
    hw = get_hardware(hardware)
    inter = None
    if inter_host_gbit is not None:
        if not (isinstance(inter_host_gbit, (int, float)) and inter_host_gbit > 0):
            raise InvalidArgumentError(f"inter_host_gbit={inter_host_gbit!r} must be a positive number")
        inter = Link(inter_host_gbit * 1e9 / 8 / devices_per_host, hw.inter_latency)
    return Cluster(hosts, devices_per_host, hw, None, inter)


def intra_link(cluster: Cluster) -> AxisLink:
    return cluster.intra_link.axis_link()


def inter_link(cluster: Cluster) -> AxisLink:
    return cluster.inter_link.axis_link()


def boundary_link(cluster: Cluster) -> AxisLink:
    """Link activations cross between consecutive stages (between hosts when there are several)."""
    return inter_link(cluster) if cluster.hosts > 1 else intra_link(cluster)


def planning_hardware(cluster: Cluster) -> str | Hardware:
    """What `PlanOptions.hardware` says to plan a stage or the whole of `cluster` with: a topology
    cluster's description (each axis priced by the levels it spans; the options' link overrides
    applied again), else the hardware record carrying the cluster's two links."""
    if cluster.topology is not None:
        return str(cluster)
    return effective_hardware(cluster)


def effective_hardware(cluster: Cluster) -> Hardware:
    """The cluster's hardware record carrying its links, for cost models built from `Hardware` alone."""
    intra, inter = cluster.intra_link, cluster.inter_link
    return dataclasses.replace(cluster.hardware, intra_latency=intra.latency, intra_bandwidth=intra.bandwidth,
                               inter_latency=inter.latency, inter_bandwidth=inter.bandwidth)


@dataclasses.dataclass(frozen=True, slots=True)
class LogicalMesh:
    """One way to view a submesh as a mesh: its shape and the link of each axis."""

    mesh: MeshSpec
    links: tuple[AxisLink, ...]
    host_axes: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], AxisLink], ...] = ()

    def cost_model(self, hardware: Hardware) -> CostModel:
        return CostModel(self.mesh, hardware, self.links, group_links=self.groups)


def _priced(lm: LogicalMesh, cluster: Cluster) -> LogicalMesh:
    """`lm` with a topology cluster's links: the mesh laid out over the cluster's first devices, each
    axis and axis group priced by the levels and torus dimensions it spans."""
    if cluster.topology is None:
        return lm
    links, groups = cluster.topo.mesh_links(lm.mesh.shape)
    return dataclasses.replace(lm, links=links, groups=groups)


# Clusters of more hosts than this plan stages on whole hosts, 2^k of them (or all): Alpa's space, every
# (1, 2^k) and every (n, M), makes the stage DP's work grow as (shapes x devices) = N^2 M; whole hosts
# in powers of two keep it to log2(N) shapes over N host counts. A pipeline of at most L stages on so
# many hosts gives each stage more than a host on average, and a stage on part of a host would need
# other part-host stages to fill it.
# The divisors of N are kept too: N / S hosts per stage is how S equal stages split the cluster
# (Megatron-LM's PP = S on 192 hosts: 24 hosts per stage), so even pipelines stay in the space.
WHOLE_HOSTS_ABOVE = 16


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[Shape, ...]:
    """Alpa's submesh shapes: (1, 2^k) up to (1, M), then (n, M) for n = 2..N; on clusters of more
    than `WHOLE_HOSTS_ABOVE` hosts (n, M) for n = 2^k and the divisors of N only. The whole cluster
    comes last."""
    if num_hosts > WHOLE_HOSTS_ABOVE:
        hosts = sorted({2 ** k for k in range(num_hosts.bit_length()) if 2 ** k <= num_hosts}
                       | {n for n in range(1, num_hosts + 1) if num_hosts % n == 0})
        return tuple((n, devices_per_host) for n in hosts)
    out: list[Shape] = []
    m = 1
    while m < devices_per_host:
        out.append((1, m))
        m *= 2
    out.append((1, devices_per_host))
    out.extend((n, devices_per_host) for n in range(2, num_hosts + 1))
    return tuple(out)


def logical_meshes(submesh: Shape, cluster: Cluster, max_ndim: int = 2) -> tuple[LogicalMesh, ...]:
    """The logical meshes a submesh is planned as.

    With `max_ndim=1`: the 1-D mesh (its axis crosses hosts when the submesh does). With 2: inside
    one host the most square 2-D factorisation (both links fast; (a, b) and (b, a) are the same
    problem), across hosts (hosts, devices) with an inter-host first axis. A 2-D mesh subsumes the
    1-D one (the planner may put both axes on one dimension), so the 1-D mesh is only kept where no
    2-D factorisation exists.
    """
    n, m = submesh
    size = n * m
    one_d = LogicalMesh(MeshSpec((size,), default_axis_names(1)),
                        (inter_link(cluster) if n > 1 else intra_link(cluster),), (0,) if n > 1 else ())
    one_d = _priced(one_d, cluster)
    if max_ndim < 2:
        return (one_d,)
    if n > 1:
        return (_priced(LogicalMesh(MeshSpec((n, m), default_axis_names(2)), (inter_link(cluster), intra_link(cluster)),
                                    (0,)), cluster),)
    factors = [a for a in range(2, size) if size % a == 0 and a * a <= size]
    if not factors:
        return (one_d,)
    a = max(factors)
    return (_priced(LogicalMesh(MeshSpec((a, size // a), default_axis_names(2)), (intra_link(cluster),) * 2, ()),
                    cluster),)


def tensor_parallel_mesh(submesh: Shape, cluster: Cluster, ways: int) -> LogicalMesh:
    """A submesh as Megatron-LM lays out `ways`-way tensor parallelism: a (size / ways, ways) mesh
    whose second axis lies inside one host (NVLink) and whose first axis (data parallelism) crosses
    hosts when the submesh does.

    Raises:
      InvalidArgumentError: `ways` does not divide the devices of one host in the submesh.
    """
    n, m = submesh
    if not (isinstance(ways, int) and ways >= 2 and m % ways == 0):
        raise InvalidArgumentError(f"tensor_parallel={ways!r} must be an int >= 2 dividing the {m} devices per "
                                   "host of each stage")
    first = inter_link(cluster) if n > 1 else intra_link(cluster)
    if n * m == ways:
        return _priced(LogicalMesh(MeshSpec((ways,), default_axis_names(1)), (intra_link(cluster),), ()), cluster)
    return _priced(LogicalMesh(MeshSpec((n * m // ways, ways), default_axis_names(2)), (first, intra_link(cluster)),
                               (0,) if n > 1 else ()), cluster)


def place_submeshes(shapes: Sequence[Shape], cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """Assigns each stage's submesh concrete device positions (host * M + device), in stage order.

    Whole-host submeshes take whole hosts in order; partial-host submeshes are packed first-fit by
    decreasing size into the hosts left over (sizes are powers of two, so packing is exact).

    Raises:
      InfeasiblePlanError: the shapes do not tile the cluster.
    """
    M = cluster.devices_per_host
    total = sum(n * m for n, m in shapes)
    if total != cluster.num_devices:
        raise InfeasiblePlanError(
            f"submeshes {list(shapes)} use {total} devices but the cluster {cluster} has {cluster.num_devices}")
    out: list[tuple[int, ...] | None] = [None] * len(shapes)
    host = 0
    for s, (n, m) in enumerate(shapes):
        if m == M and (n > 1 or M == 1):
            out[s] = tuple(range(host * M, (host + n) * M))
            host += n
    free = [M] * (cluster.hosts - host)
    order = sorted((s for s in range(len(shapes)) if out[s] is None), key=lambda s: -shapes[s][1])
    for s in order:
        size = shapes[s][1]
        for h, left in enumerate(free):
            if left >= size:
                start = (host + h) * M + (M - left)
                out[s] = tuple(range(start, start + size))
                free[h] -= size
                break
        else:
            raise InfeasiblePlanError(f"submeshes {list(shapes)} cannot be packed into the cluster {cluster}")
    return tuple(out)  # type: ignore[arg-type]
