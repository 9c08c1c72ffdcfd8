"""Public entry points: `plan_parallel` (function wrapper / decorator) and `plan`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from planner.emit import jit_planned
from planner.errors import InvalidArgumentError
from planner.graph import Graph, trace
from planner.mesh import parse_mesh
from planner.options import PlanOptions
from planner.plan import Plan
from planner.planning import check_options, make_plan
from planner.search import best_plan, candidate_meshes, search_meshes
from planner.stages.planned import plan_with_stages

__all__ = ["PlannedFunction", "candidate_meshes", "plan", "plan_parallel"]


def _signature(args: tuple[Any, ...]) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves))


class PlannedFunction:
    """A train step planned (and compiled) once per abstract signature of its arguments.

    Call it like the original function; `.plan(*args)` and `.lower(*args)` accept
    `jax.ShapeDtypeStruct` pytrees, so large models plan without allocating.
    """

    def __init__(self, fn: Callable[..., Any], mesh: Any = None, devices=None,
                 donate_argnums: int | tuple[int, ...] = (), **options: Any):
        if not callable(fn):
            raise InvalidArgumentError(f"plan_parallel needs a callable train step, got {type(fn).__name__}")
        self.fn = fn
        self.donate_argnums = donate_argnums
        self.options = check_options(PlanOptions.from_kwargs(options))
        self.devices = list(devices) if devices is not None else jax.devices()
        if mesh is None:
            self._mesh_spec, self._jax_mesh = None, None
        else:
            self._mesh_spec, self._jax_mesh = parse_mesh(mesh, len(self.devices))
            if self._jax_mesh is None:
                self._jax_mesh = self._mesh_spec.to_jax_mesh(self.devices)
            elif self._jax_mesh.devices.size != len(self.devices) and devices is None:
                self.devices = list(self._jax_mesh.devices.flat)
        self._cache: dict[tuple, tuple[Graph, Plan, Any]] = {}
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "planned")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _entry(self, args: tuple[Any, ...]) -> tuple[Graph, Plan, Any]:
        key = _signature(args)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        graph = trace(self.fn, *args)
        if self.options.pipeline:
            plan, runner = plan_with_stages(self.fn, args, graph, self._mesh_spec, self.devices, self.options)
            self._cache[key] = (graph, plan, runner)
            return self._cache[key]
        if self._mesh_spec is not None:
            plan = make_plan(graph, self._mesh_spec, self.options, self._jax_mesh)
        else:
            plan = self._choose_mesh(graph)
        entry = (graph, plan, jit_planned(graph, plan, self.donate_argnums))
        self._cache[key] = entry
        return entry

    def _choose_mesh(self, graph: Graph) -> Plan:
        return best_plan(search_meshes(graph, candidate_meshes(len(self.devices)), self.options,
                                       devices=self.devices))

    def plan(self, *args: Any) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStructs); planned once per signature."""
        return self._entry(args)[1]

    def graph(self, *args: Any) -> Graph:
        return self._entry(args)[0]

    def jitted(self, *args: Any):
        """The `jax.jit`-wrapped planned program for these arguments."""
        return self._entry(args)[2]

    def lower(self, *args: Any) -> jax.stages.Lowered:
        return self._entry(args)[2].lower(*args)

    def __call__(self, *args: Any):
        graph, plan, jitted = self._entry(args)
        if plan.stages:
            return jitted(*args)  # a pipeline: stages place their own inputs
        placed = jax.device_put(args, plan.in_shardings)
        return jitted(*placed)


def plan_parallel(fn: Callable[..., Any] | None = None, *, mesh: Any = None,
                  donate_argnums: int | tuple[int, ...] = (), **options: Any):
    """Wraps a train step so that it runs auto-sharded on `mesh`.

    Usable directly (`plan_parallel(step, mesh=(2, 4))`) or as a decorator
    (`@plan_parallel(mesh="2x4")`).

    Args:
      fn: the train step.
      mesh: a `jax.sharding.Mesh`, a shape like `(2, 4)`, a string like `"2x4"`, or None to let the
        planner choose the mesh shape as well.
      donate_argnums: arguments whose buffers the step may reuse (as in `jax.jit`), typically the
        train state: the new state then takes the old one's memory.
      **options: `PlanOptions` fields (memory_budget, hardware, solver_time_limit, ...).

    Returns:
      A `PlannedFunction` (or a decorator making one).
    """
    if fn is None:
        return lambda f: PlannedFunction(f, mesh=mesh, donate_argnums=donate_argnums, **options)
    return PlannedFunction(fn, mesh=mesh, donate_argnums=donate_argnums, **options)


def plan(fn: Callable[..., Any], *args: Any, mesh: Any = None, **options: Any) -> Plan:
    """Same as `plan_parallel(fn, mesh=mesh, **options).plan(*args)`."""
    return PlannedFunction(fn, mesh=mesh, **options).plan(*args)
