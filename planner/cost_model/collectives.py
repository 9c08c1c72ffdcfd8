"""Alpha-beta times of collectives over groups of mesh axes (ring and tree algorithms).

`nbytes` is always the size of the *full* buffer the collective produces or consumes on one device:
all-reduce: the buffer reduced; all-gather: the gathered result; reduce-scatter: the input before
scattering; all-to-all: the local buffer exchanged; collective-permute: the buffer sent.

Ring algorithms are bandwidth-optimal but pay `O(n)` latencies; for all-reduce the communication
libraries (NCCL, XLA) switch to a tree for small messages, which pays `O(log n)` latencies and moves
every byte up and down the tree. The model takes the faster of the two, which is the size-based
choice those libraries make.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from planner.core.mesh import MeshSpec

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True, slots=True)
class AxisLink:
    """Latency `alpha` (s) and inverse bandwidth `beta` (s/byte) of one mesh axis."""

    alpha: float
    beta: float


def check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring implementation over `n` devices."""
    check_kind(kind)
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * nbytes
    return float(nbytes)


def ring_steps(kind: str, n: int) -> int:
    """Latency terms (sequential message rounds) of the ring algorithm over `n` devices."""
    check_kind(kind)
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all-reduce" else 1 if kind == "collective-permute" else n - 1


def ring_time(kind: str, nbytes: float, n: int, link: AxisLink) -> float:
    return ring_steps(kind, n) * link.alpha + ring_bytes(kind, nbytes, n) * link.beta


def tree_time(kind: str, nbytes: float, n: int, link: AxisLink) -> float:
    """Pipelined-tree all-reduce (reduce to a root, broadcast back): 2 log2(n) rounds, 2x the bytes.

    Only all-reduce has a tree variant; other kinds return infinity.
    """
    if kind != "all-reduce" or n <= 1:
        return math.inf if n > 1 else 0.0
    return 2 * math.ceil(math.log2(n)) * link.alpha + 2.0 * nbytes * link.beta


def best_time(kind: str, nbytes: float, n: int, link: AxisLink) -> tuple[float, str]:
    """The faster algorithm's time and its name ("ring" or "tree")."""
    ring = ring_time(kind, nbytes, n, link)
    tree = tree_time(kind, nbytes, n, link)
    return (tree, "tree") if tree < ring else (ring, "ring")


def group_link(axes: Sequence[int], links: Sequence[AxisLink]) -> AxisLink:
    """The link a collective over several mesh axes runs at: the slowest axis sets alpha and beta
    (a ring over the group crosses the slowest axis's links; NCCL's cross-node bus bandwidth is
    the NIC's)."""
    return AxisLink(max(links[a].alpha for a in axes), max(links[a].beta for a in axes))


def analytic_time(kind: str, nbytes: float, axes: Sequence[int], mesh: MeshSpec, links: Sequence[AxisLink]) -> float:
    """Time over the devices spanned by `axes`: the faster of ring and tree at the group's link."""
    n = mesh.axis_size(axes)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return best_time(kind, nbytes, n, group_link(axes, links))[0]
