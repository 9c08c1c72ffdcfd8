"""The logical device mesh a plan is made for: axis names and sizes, independent of real devices."""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import numpy as np

from planner.core.errors import MeshError

Shape = tuple[int, ...]
_MESH_STR = re.compile(r"^\s*\d+(\s*[x,]\s*\d+)*\s*$")


@dataclasses.dataclass(frozen=True, slots=True)
class MeshSpec:
    """Logical mesh: `shape[i]` devices along axis `axis_names[i]`.

    Planning only needs this description; `to_jax_mesh` binds it to real devices for emission.
    """

    shape: Shape
    axis_names: tuple[str, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.axis_names):
            raise MeshError(f"mesh shape {self.shape} and axis names {self.axis_names} differ in length")
        if not self.shape or any((not isinstance(s, (int, np.integer))) or s < 1 for s in self.shape):
            raise MeshError(f"mesh shape {self.shape} must be a non-empty tuple of positive ints")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise MeshError(f"mesh axis names {self.axis_names} must be distinct")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis_size(self, axes: Sequence[int]) -> int:
        n = 1  # a loop, not math.prod over a generator: the ILPs' builders ask ~10^6 times per plan
        for a in axes:
            n *= self.shape[a]
        return n

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)

    def to_jax_mesh(self, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
        """A `jax.sharding.Mesh` with Auto axis types (so sharding constraints are accepted)."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) != self.size:
            raise MeshError(
                f"mesh {self} needs {self.size} devices but {len(devices)} are available; "
                f"pass a mesh whose sizes multiply to {len(devices)}"
            )
        arr = np.asarray(devices, dtype=object).reshape(self.shape)
        return jax.sharding.Mesh(
            arr, self.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * self.ndim
        )


def auto_view(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices, names and sizes with every axis Auto: what plans are emitted on.

    Meshes with Explicit (JAX's default for `jax.make_mesh`) or mixed axis types are planned and
    emitted on this view (sharding constraints need Auto axes); `PlannedFunction` hands results back
    placed with the same specs on the user's own mesh.
    """
    if all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def context_mesh() -> jax.sharding.Mesh | jax.sharding.AbstractMesh | None:
    """The mesh set by `jax.set_mesh` (or an abstract one by `jax.sharding.use_abstract_mesh`), if any."""
    mesh = jax.sharding.get_mesh()
    if mesh is not None and not getattr(mesh, "empty", not mesh.axis_names):
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and abstract.axis_names:
        return abstract
    return None


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Axis names for a mesh given only by its shape: x, y, z, then axis_3..."""
    base = ("x", "y", "z")
    return tuple(base[i] if ndim <= 3 else f"axis_{i}" for i in range(ndim))


def parse_mesh(mesh, num_devices: int | None = None) -> tuple[MeshSpec, jax.sharding.Mesh | None]:
    """Normalises the user's `mesh=` argument.

    Accepts a `jax.sharding.Mesh` or `AbstractMesh` of any axis types, a shape tuple such as
    `(2, 4)`, a string such as `"2x4"`, or a `MeshSpec`. Returns the logical description and, for a
    real `Mesh`, its Auto view (`auto_view`: the mesh itself when its axes are all Auto).
    """
    if isinstance(mesh, jax.sharding.Mesh):
        spec = MeshSpec(tuple(int(s) for s in mesh.devices.shape), tuple(str(n) for n in mesh.axis_names))
        return spec, auto_view(mesh)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        spec = MeshSpec(tuple(int(s) for s in mesh.axis_sizes), tuple(str(n) for n in mesh.axis_names))
        if num_devices is not None and spec.size != num_devices:
            raise MeshError(f"abstract mesh {spec} has {spec.size} devices but {num_devices} devices are available")
        return spec, None
    if isinstance(mesh, MeshSpec):
        spec = mesh
    elif isinstance(mesh, str):
        if not _MESH_STR.match(mesh):
            raise MeshError(f"mesh string {mesh!r} is not of the form '2x4' (sizes joined by 'x')")
        shape = tuple(int(p) for p in re.split(r"[x,]", mesh.replace(" ", "")))
        spec = MeshSpec(shape, default_axis_names(len(shape)))
    elif isinstance(mesh, (tuple, list)) and all(isinstance(s, (int, np.integer)) for s in mesh):
        shape = tuple(int(s) for s in mesh)
        spec = MeshSpec(shape, default_axis_names(len(shape)))
    else:
        raise MeshError(
            f"mesh={mesh!r} is not understood; pass a jax.sharding.Mesh, a shape like (2, 4) or a string like '2x4'"
        )
    if num_devices is not None and spec.size != num_devices:
        raise MeshError(
            f"mesh {spec} has {spec.size} devices but {num_devices} devices are available; "
            f"choose sizes whose product is {num_devices}"
        )
    return spec, None
