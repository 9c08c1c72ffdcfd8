"""Alpha-beta times of collectives over groups of mesh axes (ring algorithms).

`nbytes` is always the size of the *full* buffer the collective produces or consumes on one device:
all-reduce: the buffer reduced; all-gather: the gathered result; reduce-scatter: the input before
scattering; all-to-all: the local buffer exchanged.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.mesh import MeshSpec

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True, slots=True)
class AxisLink:
    """Latency `alpha` (s) and inverse bandwidth `beta` (s/byte) of one mesh axis."""

    alpha: float
    beta: float


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring implementation over `n` devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def ring_steps(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all-reduce" else 1 if kind == "collective-permute" else n - 1


def analytic_time(kind: str, nbytes: float, axes: Sequence[int], mesh: MeshSpec, links: Sequence[AxisLink]) -> float:
    """Ring time over the devices spanned by `axes`; the slowest axis sets alpha and beta."""
    n = mesh.axis_size(axes)
    if n <= 1 or nbytes <= 0:
        return 0.0
    alpha = max(links[a].alpha for a in axes)
    beta = max(links[a].beta for a in axes)
    return ring_steps(kind, n) * alpha + ring_bytes(kind, nbytes, n) * beta
