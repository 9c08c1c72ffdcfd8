"""Tensor shardings on a logical mesh, as plain tuples so plans are hashable and comparable.

A `Spec` has one entry per tensor dimension: the mesh axes (by index, major to minor) that split
that dimension. `((0,), (), (1,))` is `PartitionSpec('x', None, 'y')` on a mesh with axes (x, y).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import PartitionSpec

from planner.core.mesh import MeshSpec

Shape = tuple[int, ...]
Spec = tuple[tuple[int, ...], ...]


def replicated(rank: int) -> Spec:
    return ((),) * rank


def is_valid(shape: Shape, spec: Spec, mesh: MeshSpec) -> bool:
    """Every dimension divides evenly by the devices splitting it, and no axis is used twice."""
    if len(spec) != len(shape):
        return False
    used = [a for axes in spec for a in axes]
    if len(used) != len(set(used)):
        return False
    return all(d % mesh.axis_size(axes) == 0 for d, axes in zip(shape, spec))


def spec_axes(spec: Spec) -> frozenset[int]:
    """The mesh axes `spec` splits some dimension over."""
    return frozenset(a for dim in spec for a in dim)


def num_shards(spec: Spec, mesh: MeshSpec) -> int:
    n = 1  # a loop, as `MeshSpec.axis_size`: the ILPs' builders ask ~10^5 times per plan
    for axes in spec:
        n *= mesh.axis_size(axes)
    return n


def axis_dim(spec: Spec, axis: int) -> int | None:
    """The tensor dimension split by mesh `axis`, or None."""
    for d, axes in enumerate(spec):
        if axis in axes:
            return d
    return None


def active_axes(mesh: MeshSpec) -> tuple[int, ...]:
    """Mesh axes with more than one device (axes of size 1 never change a sharding)."""
    return tuple(a for a, s in enumerate(mesh.shape) if s > 1)


def enumerate_specs(shape: Shape, mesh: MeshSpec) -> Iterator[Spec]:
    """All valid specs of `shape`: each active mesh axis splits one dimension or none."""
    axes = active_axes(mesh)
    rank = len(shape)
    for choice in itertools.product(range(-1, rank), repeat=len(axes)):
        spec = [[] for _ in range(rank)]
        for a, d in zip(axes, choice):
            if d >= 0:
                spec[d].append(a)
        out = tuple(tuple(s) for s in spec)
        if is_valid(shape, out, mesh):
            yield out


def to_partition_spec(spec: Spec, mesh: MeshSpec) -> PartitionSpec:
    parts = []
    for axes in spec:
        names = tuple(mesh.axis_names[a] for a in axes)
        parts.append(None if not names else names[0] if len(names) == 1 else names)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def named_sharding(spec: Spec, mesh: MeshSpec, jax_mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(jax_mesh, to_partition_spec(spec, mesh))


def format_spec(spec: Spec, mesh: MeshSpec) -> str:
    """`P(x, None, y)`-style text for tables and explanations."""
    parts = []
    for axes in spec:
        names = [mesh.axis_names[a] for a in axes]
        parts.append("None" if not names else names[0] if len(names) == 1 else "(" + ",".join(names) + ")")
    return "P(" + ", ".join(parts) + ")"


def spec_to_json(spec: Spec) -> list[list[int]]:
    return [list(axes) for axes in spec]


def spec_from_json(data: Sequence[Sequence[int]]) -> Spec:
    return tuple(tuple(int(a) for a in axes) for axes in data)


def optimizer_spec(shape: Shape, spec: Sequence[Sequence], axes: Sequence, sizes: dict) -> tuple | None:
    """The layout of an optimizer-state leaf mirroring a parameter laid out as `spec`, in a
    pipeline stage that shards its optimizer state over its data-parallel `axes` (the
    "sharded-optimizer" state layout: Megatron-LM's distributed optimizer, ZeRO stage 1): `spec` with
    those of `axes` it does not use appended to one dimension, the largest shard that divides by
    them, so that the gradient's reduction over the replicas is one reduce-scatter along that
    dimension (`jax.lax.psum_scatter`) and the updated parameter one all-gather back. None where
    nothing is added (no such axis, or no dimension divides). Axes are whatever `spec` holds (mesh
    axis indices in the planner, names in the runtime); `sizes` maps each to its size."""
    used = {a for dim in spec for a in dim}
    extra = tuple(a for a in axes if a not in used and sizes[a] > 1)
    if not extra:
        return None
    ways = 1
    for a in extra:
        ways *= sizes[a]

    def split(d: int) -> int:
        n = 1
        for a in spec[d]:
            n *= sizes[a]
        return n

    fits = [d for d in range(len(shape)) if shape[d] % (split(d) * ways) == 0]
    if not fits:
        return None
    d = max(fits, key=lambda d: (shape[d] // split(d), -d))
    return tuple(tuple(spec[k]) + (extra if k == d else ()) for k in range(len(shape)))
