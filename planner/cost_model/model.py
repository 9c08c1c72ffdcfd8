"""The cost model: every number the search uses comes from here."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from planner.cost_model.collectives import AxisLink, analytic_time
from planner.cost_model.hardware import DEFAULT_HARDWARE, Hardware
from planner.mesh import MeshSpec


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Times of collectives per mesh axis group and of local compute.

    Attributes:
      mesh: the logical mesh.
      hardware: peak figures for compute.
      links: alpha/beta of each mesh axis.
    """

    mesh: MeshSpec
    hardware: Hardware
    links: tuple[AxisLink, ...]

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

    def collective_time(self, kind: str, nbytes: float, axes: Sequence[int], combined: bool = False) -> float:
        """Seconds for collective `kind` on a `nbytes` buffer over the devices spanned by `axes`.

        `combined=True` drops the latency term: XLA's collective combiners merge independent
        reductions (the gradient reductions of a train step) into one, so their latency is paid once.
        """
        if combined:
            links = tuple(AxisLink(0.0, link.beta) for link in self.links)
            return analytic_time(kind, nbytes, tuple(axes), self.mesh, links)
        return analytic_time(kind, nbytes, tuple(axes), self.mesh, self.links)

    def compute_time(self, flops: float, bytes_accessed: float, dtype: np.dtype | None = None) -> float:
        """Roofline: the larger of FLOP time and memory time on one device."""
        low = dtype is not None and np.dtype(dtype).itemsize <= 2
        peak = self.hardware.flops_bf16 if low else self.hardware.flops_f32
        return max(flops / peak, bytes_accessed / self.hardware.memory_bandwidth)
