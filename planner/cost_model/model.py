"""The cost model: every number the search uses comes from here."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from planner.cost_model.cluster import Cluster
from planner.cost_model.collectives import AxisLink, best_time, check_kind, group_link, ring_steps
from planner.cost_model.hardware import (
    DEFAULT_HARDWARE,
    Hardware,
    get_hardware,
    hardware_for_device_kind,
    matmul_rate,
    peak_flops,
    rate_class,
)
from planner.cost_model.topology import is_topology
from planner.cost_model.profile_db import MeasuredCollectives, ProfileDB, bind, check_device_kind, load_profile
from planner.cost_model.profile_levels import measured_levels, profiled_topology
from planner.core.errors import MeshError, ProfileError
from planner.core.mesh import MeshSpec

log = logging.getLogger("planner")


def profiled_hardware(profile: Any, hardware: str | Hardware | None = None) -> Hardware:
    """The hardware a profile database describes: the preset of its device kind (or `hardware`, or
    the default preset's figures under the device kind's name when no preset matches), with every
    figure the profile measured replacing the preset's: matmul FLOP/s per dtype, memory bandwidth,
    device memory, kernel launch floor. The one source of the hardware a `--profile` plan names,
    its default memory budget and its MFU, and of the cost model built from the profile.

    Raises:
      ProfileError: an unreadable or corrupt database.
    """
    db: ProfileDB = load_profile(profile)
    base = get_hardware(hardware) if hardware is not None else hardware_for_device_kind(db.device_kind)
    if base is None:
        base = dataclasses.replace(DEFAULT_HARDWARE, name=db.device_kind.strip().lower() or "profiled",
                                   device_kind="")
    flops = dict(db.matmul_flops)
    curve = matmul_curve(db)
    if not curve:
        log.info("profile %s has no GEMM curve (no matmul samples): contractions run at the %s preset's "
                 "rate", db.name, base.name)
    heads = attention_curve(db)
    if curve and not heads:
        log.info("profile %s has no attention-shape curve (made before `planner profile` swept them): "
                 "batched narrow GEMMs run at the square GEMM curve", db.name)
    return dataclasses.replace(
        base,
        matmul_curve=curve or base.matmul_curve,
        attention_curve=heads or base.attention_curve,
        # measured peaks are achieved rates already
        matmul_efficiency=1.0 if flops else base.matmul_efficiency,
        flops_f32=flops.get("float32", base.flops_f32),
        flops_bf16=flops.get("bfloat16", base.flops_bf16),
        memory_bandwidth=db.memory_bandwidth or base.memory_bandwidth,
        memory_efficiency=1.0 if db.memory_bandwidth else base.memory_efficiency,  # measured: achieved already
        rates_source=_profile_source(db, bool(curve), bool(db.memory_bandwidth), base),
        memory_bytes=db.device_memory_bytes or base.memory_bytes,
        kernel_launch_s=base.kernel_launch_s if db.kernel_launch_s is None else db.kernel_launch_s,
        host_bandwidth=db.host_bandwidth or base.host_bandwidth,
        platform=db.platform if db.platform in ("gpu", "tpu", "cpu") else base.platform,
    )


def _profile_source(db: ProfileDB, curve: bool, bandwidth: bool, base: Hardware) -> str:
    """`Hardware.rates_source` of a profiled device: what the profile measured, and what is the preset's."""
    measured = [what for what, ok in (("GEMM sweep", curve), ("memory bandwidth", bandwidth)) if ok]
    if not measured:
        return f"profile {db.name} measured no rates; {base.name} preset: {base.rates_source}"
    rest = "" if curve and bandwidth else f"; the rest from the {base.name} preset"
    return f"measured by planner profile ({db.name}: {', '.join(measured)}){rest}"


def _best_rates(db: ProfileDB, kind: str, point: Callable[[Mapping[str, Any]], tuple[Any, float, bool]]
                ) -> dict[tuple, tuple[tuple[float, float], ...]]:
    """FLOPs-sorted (flops per kernel, FLOP/s) points of a profile's `kind` samples, per (dtype class,
    *the sample's key*): `point(sample)` gives (key, FLOPs, whether its sizes are positive); the best
    rate where two samples share a point. Samples with missing, malformed or non-finite figures are
    skipped."""
    points: dict[tuple, dict[float, float]] = {}
    for s in db.compute_samples:
        if s.get("kind") != kind:
            continue
        try:
            key, flops, sized = point(s)
            rate, dtype = float(s["flops_per_s"]), str(s["dtype"])
        except (KeyError, TypeError, ValueError):
            continue
        if sized and rate > 0 and np.isfinite(rate):
            by_flops = points.setdefault((rate_class((dtype,)), *key), {})
            by_flops[flops] = max(rate, by_flops.get(flops, 0.0))
    return {k: tuple(sorted(p.items())) for k, p in sorted(points.items())}


def matmul_curve(db: ProfileDB) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """The measured matmul rates of a profile (`Hardware.matmul_curve`): FLOPs of each swept square
    GEMM (2 n^3) and its FLOP/s, per dtype class; the best rate where two samples share a size."""
    def point(s):
        n = float(s["n"])
        return (), 2 * n**3, n > 0

    return tuple((cls, p) for (cls,), p in _best_rates(db, "matmul", point).items())


def attention_curve(db: ProfileDB) -> tuple[tuple[str, int, tuple[tuple[float, float], ...]], ...]:
    """The measured attention-shape rates of a profile (`Hardware.attention_curve`): per dtype class
    and head dimension d, the FLOPs of one of the two swept matmuls (2 g s^2 d) and its FLOP/s; the
    best rate where two samples share a point."""
    def point(s):
        g, seq, d = int(s["batch"]), int(s["seq"]), int(s["head_dim"])
        return (d,), 2.0 * g * seq * seq * d, min(g, seq, d) > 0

    return tuple((cls, d, p) for (cls, d), p in _best_rates(db, "attention", point).items())


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Times of collectives per mesh axis group and of local compute.

    Attributes:
      mesh: the logical mesh.
      hardware: peak figures for compute (measured figures when built from a profile).
      links: alpha/beta of each mesh axis, for the analytic model.
      measured: profiled curves per (collective, axis group); where present they replace the
        analytic time.
      group_links: ((axes, link), ...) for groups of several axes the topology prices otherwise
        than by their slowest axis (a torus: a group over several dimensions uses all their ports);
        other groups run at their slowest axis's link (`collectives.group_link`).
      comm_precision: the wire formats collectives may use (`planner.ilp.wire`).
      part_times: `ilp.strategies.part_time`'s answers on this model (not a field of its value:
        a model made by `dataclasses.replace` starts with none); the ILPs sharing the model share them.
      answers: likewise `ilp.problem.build_problem`'s strategy enumerations and follower answers.
      edge_forms: likewise `ilp.edge_forms.edge_form`'s answers (an edge's cost per part, grouped).
    """

    mesh: MeshSpec
    hardware: Hardware
    links: tuple[AxisLink, ...]
    measured: MeasuredCollectives | None = None
    group_links: tuple[tuple[tuple[int, ...], AxisLink], ...] = ()
    comm_precision: str = "exact"  # the wire formats collectives may use (`PlanOptions.comm_precision`)
    part_times: dict = dataclasses.field(default_factory=dict, init=False, compare=False, hash=False, repr=False)
    answers: dict = dataclasses.field(default_factory=dict, init=False, compare=False, hash=False, repr=False)
    edge_forms: dict = dataclasses.field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __post_init__(self):
        if len(self.links) != self.mesh.ndim:
            raise ValueError(f"{len(self.links)} axis links given for a {self.mesh.ndim}-axis mesh {self.mesh}")

    @classmethod
    def default(cls, mesh: MeshSpec, hardware: Hardware = DEFAULT_HARDWARE,
                inter_host_axes: Sequence[int] = ()) -> CostModel:
        """Analytic model: every axis on the intra-host link except `inter_host_axes`."""
        links = tuple(
            AxisLink(hardware.inter_latency, 1.0 / hardware.inter_bandwidth)
            if a in inter_host_axes
            else AxisLink(hardware.intra_latency, 1.0 / hardware.intra_bandwidth)
            for a in range(mesh.ndim)
        )
        return cls(mesh, hardware, links)

    @classmethod
    def for_cluster(cls, mesh: MeshSpec, cluster: Cluster) -> CostModel:
        """Analytic model of `mesh` laid out row-major over `cluster`: axes that span hosts use the
        inter-host link."""
        return cls(mesh, cluster.hardware, cluster.axis_links(mesh), group_links=cluster.group_links(mesh))

    @classmethod
    def on_topology(cls, mesh: MeshSpec, cluster: Cluster) -> CostModel:
        """Analytic model of `mesh` laid out row-major over a topology cluster's first `mesh.size`
        devices (all of them, or a pipeline stage's submesh, a smaller mesh planned for it).

        Raises:
          MeshError: a mesh of more devices than the cluster has.
        """
        if mesh.size > cluster.num_devices:
            raise MeshError(f"cluster {str(cluster)!r} has {cluster.num_devices} devices but the mesh {mesh} has "
                            f"{mesh.size}; describe the cluster the mesh runs on")
        if mesh.size == cluster.num_devices:
            return cls.for_cluster(mesh, cluster)
        links, groups = cluster.topo.mesh_links(mesh.shape)
        return cls(mesh, cluster.hardware, links, group_links=groups)

    @classmethod
    def from_profile(cls, mesh: MeshSpec, profile: Any, hardware: str | Hardware | None = None,
                     inter_host_axes: Sequence[int] | None = None, device_kind: str | None = None) -> CostModel:
        """Measured model: profiled curves where the database has the (collective, axis group),
        the analytic model elsewhere.

        Args:
          mesh: the planning mesh.
          profile: a database path, a `ProfileDB`, or its parsed JSON.
          hardware: the hardware planned for; None means the devices this process sees (or
            `device_kind`), whose kind must match the database's.
          inter_host_axes: axes on the inter-host link in the analytic fallback; None: the axes that
            span hosts of the profiled cluster.
          device_kind: the device kind planned for when `hardware` is None (default: this process's).

        Raises:
          ProfileError: an unreadable or corrupt database, or one measured on other devices or
            another number of devices.

        Warns:
          ProfileWarning: the database was measured on another mesh shape and serves only in part.
        """
        db: ProfileDB = load_profile(profile)
        hw = get_hardware(hardware) if hardware is not None else None
        if hw is None and device_kind is None:
            device_kind = jax.devices()[0].device_kind
        check_device_kind(db, hw, device_kind if hw is None else None)
        if is_topology(hardware) and db.num_devices != mesh.size:
            return cls.from_profiled_levels(mesh, db, str(hardware))
        measured = bind(db, mesh)
        if db.jax_version not in (jax.__version__, "synthetic"):
            log.info("profile %s was measured with jax %s; this is jax %s (collective implementations may differ)",
                     db.name, db.jax_version, jax.__version__)
        base = profiled_hardware(db, hw)
        inter = measured.inter_host_axes if inter_host_axes is None else tuple(inter_host_axes)
        fallback = cls.default(mesh, base, inter).links
        links = tuple(m if m is not None else f for m, f in zip(measured.links, fallback))
        return cls(mesh, base, links, measured)

    @classmethod
    def from_profiled_levels(cls, mesh: MeshSpec, db: ProfileDB, topology: str) -> CostModel:
        """A topology planned with a profile measured on other devices of the same kind (another slice
        shape, another host count): the profile's compute rates, and each level's link from what its
        collectives measured (`profile_db.measured_levels`: innermost level for innermost level,
        outermost for outermost); levels it did not measure keep the preset's figures.

        Raises:
          ProfileError: the profile measured no collective to read a level from.
        """
        cluster = Cluster.parse(topology)
        measured = measured_levels(db)
        if not measured:
            raise ProfileError(f"profile {db.name} has no single-axis collective to read its links from; re-run "
                               "`planner profile` (with its default collectives)")
        profiled_depth = len(profiled_topology(db).levels)
        levels = list(cluster.topology.levels)
        used = []
        for i, link in sorted(measured.items()):
            j = 0 if i == 0 else len(levels) - 1 if i == profiled_depth - 1 and len(levels) > 1 else None
            if j is None:
                continue
            levels[j] = dataclasses.replace(levels[j], link=link)
            used.append(f"{levels[j].name} {link.bandwidth / 1e9:.3g} GB/s")
        log.info("profile %s (%d devices) serves %s by its levels: %s", db.name, db.num_devices, topology,
                 ", ".join(used))
        linked = dataclasses.replace(cluster, hardware=profiled_hardware(db, cluster.hardware),
                                     topology=dataclasses.replace(cluster.topology, levels=tuple(levels)))
        return cls.on_topology(mesh, linked)

    @classmethod
    def build(cls, mesh: MeshSpec, hardware: str | Hardware | None = None, inter_host_axes: Sequence[int] = (),
              profile: Any = None) -> CostModel:
        """The model planner options ask for: profiled when `profile` is given, analytic otherwise.

        Args:
          mesh: the planning mesh.
          hardware: a preset name, a `Hardware`, a cluster description such as "2x8:h100" (the
            axes spanning hosts then use the inter-host link), or None.
          inter_host_axes: axes on the inter-host link (overrides what the cluster or profile says).
          profile: a profile database (path or loaded) or None.

        Raises:
          MeshError: a cluster description with another number of devices than the mesh.
          ProfileError: an unusable profile.
        """
        if profile is not None:
            return cls.from_profile(mesh, profile, hardware, tuple(inter_host_axes) or None)
        if is_topology(hardware):
            return cls.on_topology(mesh, Cluster.parse(hardware))
        if Cluster.is_cluster(hardware) and not inter_host_axes:
            cluster = Cluster.parse(hardware)
            if cluster.num_devices != mesh.size:
                raise MeshError(f"cluster {hardware!r} has {cluster.num_devices} devices but the mesh {mesh} has "
                                f"{mesh.size}; describe the cluster the mesh runs on")
            return cls.for_cluster(mesh, cluster)
        return cls.default(mesh, get_hardware(hardware), tuple(inter_host_axes))

    def collective_time(self, kind: str, nbytes: float, axes: Sequence[int], combined: bool = False) -> float:
        """Seconds for collective `kind` on a `nbytes` buffer over the devices spanned by `axes`.

        `combined=True` drops the latency term: XLA's collective combiners merge independent
        reductions (the gradient reductions of a train step) into one, so their latency is paid once.
        """
        axes = tuple(sorted(a for a in axes if self.mesh.shape[a] > 1))
        if nbytes <= 0 or not axes:
            check_kind(kind)
            return 0.0
        if self.measured is not None:
            curve = self.measured.get(kind, axes)
            if curve is not None:
                t = curve(nbytes)
                return max(0.0, t - curve.fit.alpha) if combined else t
        link = self.link_of(axes)
        if combined:
            link = AxisLink(0.0, link.beta)
        return best_time(kind, nbytes, self.mesh.axis_size(axes), link)[0]

    def link_of(self, axes: Sequence[int]) -> AxisLink:
        """The link a collective over `axes` (sorted, of size > 1) runs at."""
        axes = tuple(axes)
        if len(axes) > 1:
            for group, link in self.group_links:
                if group == axes:
                    return link
        return group_link(axes, self.links)

    def collective_latency(self, kind: str, axes: Sequence[int]) -> float:
        """The latency `collective_time(..., combined=True)` leaves out: what one combined collective
        of `kind` over `axes` pays once (the ring's message rounds at the group's slowest link, the
        measured curve's intercept where profiled)."""
        check_kind(kind)
        axes = tuple(sorted(a for a in axes if self.mesh.shape[a] > 1))
        if not axes:
            return 0.0
        if self.measured is not None:
            curve = self.measured.get(kind, axes)
            if curve is not None:
                return max(0.0, curve.fit.alpha)
        return ring_steps(kind, self.mesh.axis_size(axes)) * self.link_of(axes).alpha

    def algorithm(self, kind: str, nbytes: float, axes: Sequence[int]) -> str:
        """How the time of `collective_time` is obtained: "measured", "ring" or "tree"."""
        axes = tuple(sorted(a for a in axes if self.mesh.shape[a] > 1))
        if self.measured is not None and self.measured.get(kind, axes) is not None:
            return "measured"
        n = self.mesh.axis_size(axes)
        return best_time(kind, nbytes, n, self.link_of(axes))[1] if n > 1 else "ring"

    def compute_time(self, flops: float, bytes_accessed: float,
                     dtypes: np.dtype | Iterable[np.dtype] | None = None, kernels: int = 0,
                     narrow: int | None = None) -> float:
        """Roofline with a launch floor: the largest of FLOP time, memory time and `kernels` times
        the hardware's `kernel_launch_s`, on one device.

        `dtypes` are the values whose precision sets the FLOP rate (`hardware.peak_flops`): a dot's or
        convolution's operands, another op's results; one dtype or several; None means float32.
        `kernels`: the kernels the op surely runs as (1 for a dot or convolution, which XLA never
        fuses with each other; 0 for ops that may fuse into a neighbour's kernel). A contraction
        (kernels > 0) runs at the achieved matmul rate (`hardware.matmul_rate`: a profiled curve,
        or the peak times the preset's cited `matmul_efficiency`); other ops' FLOPs at the peak.
        `narrow`: a batched contraction's narrowest dimension (`hardware.matmul_rate`), which picks
        the measured attention-shape curve where the profile has one.
        """
        if dtypes is None:
            dtypes = ()
        elif isinstance(dtypes, (np.dtype, str, type)):
            dtypes = (dtypes,)
        rate = (matmul_rate(self.hardware, dtypes, flops / kernels, narrow) if kernels > 0
                else peak_flops(self.hardware, dtypes))
        return max(flops / rate, bytes_accessed / self.hardware.achieved_bandwidth,
                   kernels * self.hardware.kernel_launch_s)
