"""Mesh search: plan one program on several logical mesh shapes and rank them by predicted time.

`plan_parallel(step)` without a mesh and `planner plan --devices N` both search here: the same
candidates, the same per-mesh planning, the same order (fastest first, then the meshes that did
not fit the memory budget, least memory first, then the unusable ones).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from planner.cost_model import Cluster
from planner.errors import InfeasiblePlanError, MeshError, PlannerError
from planner.graph import Graph
from planner.mesh import MeshSpec, default_axis_names
from planner.options import PlanOptions
from planner.plan import Plan
from planner.planning import make_plan
from planner.units import format_bytes

log = logging.getLogger("planner")


def candidate_meshes(num_devices: int, max_ndim: int = 2) -> list[MeshSpec]:
    """Logical mesh shapes to try when the user gives none: (n,) and every 2-D factorisation."""
    out = [MeshSpec((num_devices,), default_axis_names(1))]
    if max_ndim >= 2:
        for a in range(2, num_devices):
            if num_devices % a == 0:
                out.append(MeshSpec((a, num_devices // a), default_axis_names(2)))
    return out


def inter_host_axes(shape: Sequence[int], devices_per_host: int) -> tuple[int, ...]:
    """Mesh axes whose device groups span more than one host, for devices numbered host-major
    (host h owns devices h*D ... h*D+D-1) and laid out row-major on the mesh, as `jax.make_mesh`
    does for a uniform cluster."""
    size = math.prod(shape)
    cluster = Cluster(max(1, size // devices_per_host), min(size, devices_per_host))
    return cluster.inter_host_axes(MeshSpec(tuple(shape), default_axis_names(len(shape))))


@dataclasses.dataclass(frozen=True, slots=True)
class MeshResult:
    """The outcome of planning on one mesh.

    Attributes:
      mesh: the logical mesh.
      plan: the plan, or None when planning failed.
      error: why planning failed (an `InfeasiblePlanError` when no plan fits the memory budget).
      inter_host_axes: the mesh axes planned over inter-host links.
      plan_time_s: seconds spent planning this mesh.
      same_as: for a mesh not planned because it is another candidate with its axes permuted
        (same axis sizes on the same links: the same problem, `mirror_key`), that candidate.
    """

    mesh: MeshSpec
    plan: Plan | None
    error: PlannerError | None
    inter_host_axes: tuple[int, ...]
    plan_time_s: float
    same_as: MeshSpec | None = None

    @property
    def over_budget(self) -> bool:
        return isinstance(self.error, InfeasiblePlanError)

    @property
    def min_memory_bytes(self) -> int | None:
        """The smallest reachable per-device peak when the mesh is over budget (if the solver found it)."""
        return getattr(self.error, "min_memory_bytes", None)


def search_meshes(graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                  devices_per_host: int | None = None, devices: Sequence[Any] | None = None) -> tuple[MeshResult, ...]:
    """Plans `graph` on every mesh; returns the results, planned ones fastest first, failures last.

    Args:
      graph: the traced program.
      meshes: the logical meshes to try (e.g. `candidate_meshes(n)`).
      options: planner options; with `devices_per_host`, each mesh's `inter_host_axes` are derived
        from its shape instead of taken from `options`.
      devices_per_host: devices per host of a multi-host target (None: `options.inter_host_axes`).
      devices: real devices to bind each plan's `jax.sharding.Mesh` to (None: abstract meshes).
    """
    done, failed, mirrors = [], [], []
    seen: dict[tuple, MeshResult] = {}
    for k, spec in enumerate(meshes, 1):
        inter = inter_host_axes(spec.shape, devices_per_host) if devices_per_host else options.inter_host_axes
        key = mirror_key(spec, inter) if options.profile is None else None
        twin = seen.get(key) if key is not None else None
        if twin is not None:
            log.info("mesh %s: the problem of mesh %s with its axes permuted; not planned again", spec, twin.mesh)
            if twin.plan is not None:
                mirrors.append(MeshResult(spec, None, None, inter, 0.0, same_as=twin.mesh))
            else:
                failed.append(MeshResult(spec, None, twin.error, inter, 0.0, same_as=twin.mesh))
            continue
        log.info("planning mesh %s (%d/%d) ...", spec, k, len(meshes))
        t0 = time.perf_counter()
        try:
            jax_mesh = spec.to_jax_mesh(devices) if devices is not None else None
            plan = make_plan(graph, spec, dataclasses.replace(options, inter_host_axes=inter), jax_mesh)
        except (MeshError, PlannerError) as e:
            failed.append(MeshResult(spec, None, e, inter, time.perf_counter() - t0))
            if key is not None:
                seen[key] = failed[-1]
            log.info("mesh %s: %s", spec, "no plan fits the budget" if isinstance(e, InfeasiblePlanError) else e)
            continue
        done.append(MeshResult(spec, plan, None, inter, time.perf_counter() - t0))
        if key is not None:
            seen[key] = done[-1]
        log.info("mesh %s: %.4g s/step, %s/device, planned in %.1fs", spec, plan.prediction.step_time_s,
                 format_bytes(plan.prediction.memory_bytes_per_device), time.perf_counter() - t0)
    done.sort(key=lambda r: r.plan.prediction.step_time_s)
    failed.sort(key=lambda r: (not r.over_budget, r.min_memory_bytes or 0))
    return tuple(done + mirrors + failed)


def mirror_key(spec: MeshSpec, inter: Sequence[int]) -> tuple:
    """Meshes with equal keys are one planning problem: the same axis sizes on the same links, in
    another order (2x4 and 4x2 inside one host). The cost model sees an axis only through its size
    and its link (inter-host or not), and strategies range over every assignment of axes to
    dims, so a permutation of the axes permutes the plans and leaves every predicted number as it is
    (a profile measures each axis group separately, so `search_meshes` does not use this then)."""
    return tuple(sorted((size, axis in inter) for axis, size in enumerate(spec.shape)))


def best_plan(results: Sequence[MeshResult]) -> Plan:
    """The fastest plan of a `search_meshes` result.

    Raises:
      MeshError: no mesh could be planned (each mesh's reason is listed).
    """
    if results and results[0].plan is not None:
        return results[0].plan
    raise MeshError("no mesh shape could be planned:\n  " + "\n  ".join(f"{r.mesh}: {r.error}" for r in results))
